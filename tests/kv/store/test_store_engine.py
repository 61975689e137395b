"""Two engines sharing KV through each tier (real shm arena, real files, a real redis-server): a prefix one
engine computed is loaded by the other (`num_cached_tokens` says so), and greedy output stays token-identical
to transformers in float32, also when the tier is corrupted, killed or stalled mid-run."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.config import KVStoreConfig
from kvbaton.kv.redis_server import start_redis_server
from kvbaton.kv.store.shm_tier import ShmTier
from tests.support.budget import release_memory
from tests.support.helpers import hf_greedy

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_NEW = 12
SYSTEM = 150  # tokens shared by every prompt


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(13)
    system = [rng.randrange(100, 40000) for _ in range(SYSTEM)]
    return [system + [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 60))] for _ in range(3)]


@pytest.fixture(scope="module")
def references(default_model_dir, prompts) -> list[list[int]]:
    return hf_greedy(default_model_dir, prompts, MAX_NEW)


def engine(store: KVStoreConfig) -> LLM:
    return LLM(dtype="float32", kv_store=store, num_blocks=128, block_size=BLOCK)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs], [o.metrics.num_cached_tokens for o in outs]


def full_blocks(prompt: list[int]) -> int:
    """Tokens a prefix hit can cover: whole blocks, leaving the last token to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def check_and_close(llm: LLM) -> None:
    llm.engine.core.check_integrity()
    llm.engine.core.close()  # a tier's queued writes land first


def run_first_engine(store: KVStoreConfig, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Engine A's whole life: it runs `prompts`, is checked and closed, and is gone (its memory given back) before
    the caller starts B. Its blocks outlive it in every tier; one default-model engine at a time (RSS budget)."""
    a = engine(store)
    out = run(a, prompts)
    check_and_close(a)
    del a
    release_memory()
    return out


@pytest.fixture
def redis_url():
    server = start_redis_server(maxmemory_mb=256, maxmemory_policy="allkeys-lru")
    yield server
    server.stop()
    assert not os.path.exists(f"/proc/{server.pid}")


def store_for(kind: str, tmp_path: Path, redis_server) -> KVStoreConfig:
    if kind == "shm":
        return KVStoreConfig(tiers=("shm",), shm_name=f"t{os.getpid()}-{tmp_path.name[-20:]}", shm_gb=0.25)
    if kind == "disk":
        return KVStoreConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"), disk_gb=0.25)
    return KVStoreConfig(tiers=("redis",), redis_url=redis_server.url)


@pytest.mark.parametrize("kind", ["shm", "disk", "redis"])
def test_a_prefix_computed_by_one_engine_is_loaded_by_another(kind, tmp_path, redis_url, prompts, references):
    store = store_for(kind, tmp_path, redis_url)
    outs_a, cached_a = run_first_engine(store, prompts[:1])
    b = engine(store)
    outs_b, cached_b = run(b, prompts)
    assert outs_a == references[:1] and outs_b == references
    assert cached_a == [0]
    assert cached_b[0] == full_blocks(prompts[0])  # the whole prompt, from A through the tier
    assert all(c >= SYSTEM // BLOCK * BLOCK for c in cached_b[1:])  # the system prompt, from A or B itself
    [tier] = b.engine.core.store.stats()
    assert tier.hits >= full_blocks(prompts[0]) // BLOCK and tier.corrupt == tier.errors == 0
    check_and_close(b)
    if kind == "shm":
        ShmTier.destroy(store.shm_name, b.engine.core.kv_layout.bytes_per_block)


def test_a_corrupt_block_on_disk_is_recomputed(tmp_path, prompts, references):
    store = KVStoreConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"), disk_gb=0.25)
    run_first_engine(store, prompts[:1])
    files = sorted((tmp_path / "kv").rglob("*.kvb"), key=lambda p: p.stat().st_mtime_ns)
    victim = files[3]  # the 4th block of the prompt: blocks 0-2 load, the rest is recomputed
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    b = engine(store)
    outs, cached = run(b, prompts[:1])
    assert outs == references[:1]
    [tier] = b.engine.core.store.stats()
    assert tier.corrupt == 1 and cached == [3 * BLOCK]
    check_and_close(b)


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_dead_or_stalled_redis_costs_recomputation_only(fault, prompts, references):
    """SIGKILL, or SIGSTOP (every call would time out): the first error opens the tier's breaker, and B
    recomputes what it would have loaded."""
    server = start_redis_server()
    try:
        store = KVStoreConfig(tiers=("redis",), redis_url=server.url)
        run_first_engine(store, prompts[:1])
        b = engine(store)
        os.kill(server.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        outs, cached = run(b, prompts)
        assert outs == references and cached[0] == 0  # nothing loaded: the tier failed before B asked
        [tier] = b.engine.core.store.stats()
        assert tier.errors >= 1
        check_and_close(b)
    finally:
        if fault == "stalled":
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def test_a_prefix_reaches_another_engine_through_a_mooncake_store(prompts, references):
    """The alternative cluster tier: a private Mooncake Store (its master, and the process holding its memory)."""
    from kvbaton.kv.store.mooncake_store import start_mooncake_store

    with start_mooncake_store(256 * 2**20) as mooncake:
        store = KVStoreConfig(tiers=("mooncake",), mooncake_master=mooncake.master,
                              mooncake_metadata_url=mooncake.metadata_url, mooncake_gb=0.25)
        outs_a, _ = run_first_engine(store, prompts[:1])  # its blocks stay, in the store's own process
        b = engine(store)
        outs_b, cached_b = run(b, prompts)
        assert outs_a == references[:1] and outs_b == references
        assert cached_b[0] == full_blocks(prompts[0])
        [tier] = b.engine.core.store.stats()
        assert tier.name == "mooncake" and tier.hits >= full_blocks(prompts[0]) // BLOCK
        assert tier.corrupt == tier.errors == 0
        check_and_close(b)
