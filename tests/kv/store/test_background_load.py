"""A prefix found in a tier that waits on the network (a real redis-server) while other requests run is loaded in
the background: the running streams keep getting a token every step meanwhile, the loaded request's output is
token-identical to transformers (float32), and one aborted mid-load gives its blocks back once the loader is done
with them. A copy from shared memory stays in the step (cheaper there on a CPU)."""

from __future__ import annotations

import os

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.config import KVStoreConfig
from tests.support.budget import release_memory
from tests.support.helpers import hf_greedy, prompt_of

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_NEW = 8


@pytest.fixture
def store(server, store) -> KVStoreConfig:  # the module's redis-server (tests/kv/conftest.py), emptied per test
    store.flushall()
    return KVStoreConfig(tiers=("redis",), redis_url=server.url)


@pytest.fixture
def arena(tmp_path) -> KVStoreConfig:
    from kvbaton.kv.store.shm_tier import remove_arenas

    name = f"bg{os.getpid()}-{tmp_path.name[-16:]}"
    yield KVStoreConfig(tiers=("shm",), shm_name=name, shm_gb=0.25)
    remove_arenas(name)


def engine(store: KVStoreConfig) -> LLM:
    return LLM(dtype="float32", kv_store=store, num_blocks=160, block_size=BLOCK)


def computed_elsewhere(store: KVStoreConfig, prompt: list[int]) -> None:
    """Another engine computes `prompt` (its blocks go into the store) and stops."""
    a = engine(store)
    a.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    a.engine.core.store.flush()
    a.engine.core.close()
    del a  # gone (an engine holds reference cycles: gc) before the caller builds B: the suite's 2 GiB budget
    release_memory()


def stepped(outputs, request_id: str) -> int:
    """1 if this step gave `request_id` a token (an output), else 0."""
    return sum(o.request_id == request_id for o in outputs)


def test_a_store_hit_loads_in_the_background_while_others_decode(store, default_model_dir):
    long, stream = prompt_of(600, seed=1), prompt_of(30, seed=2)
    ref = hf_greedy(default_model_dir, [long], MAX_NEW)[0]
    computed_elsewhere(store, long)

    b = engine(store).engine
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    b.add_request("stream", {"prompt_token_ids": stream}, SamplingParams(temperature=0, max_tokens=60,
                                                                          ignore_eos=True))
    for _ in range(3):  # its prompt, then decoding
        b.step()
    b.add_request("long", {"prompt_token_ids": long}, greedy)
    steps_while_loading = stream_tokens_meanwhile = 0
    long_tokens: list[int] = []
    cached = None
    for _ in range(200):  # bounded: the load lands within a few steps
        outs = b.step()
        if b.core.scheduler.loading:
            steps_while_loading += 1
            stream_tokens_meanwhile += stepped(outs, "stream")
        for o in outs:
            if o.request_id == "long":
                long_tokens = list(o.outputs[0].token_ids)
                cached = o.metrics.num_cached_tokens if o.finished else cached
        if cached is not None:
            break
    assert steps_while_loading >= 1  # the load was in the background ...
    assert stream_tokens_meanwhile == steps_while_loading  # ... and the stream got a token every step meanwhile
    assert long_tokens == ref
    assert cached == (len(long) - 1) // BLOCK * BLOCK  # the whole prefix came from the arena
    assert b.core.scheduler.num_store_hit_tokens == cached
    b.check_integrity()
    b.core.close()


def test_a_request_aborted_while_its_prefix_loads_frees_its_blocks_after(store):
    long, stream = prompt_of(600, seed=3), prompt_of(30, seed=4)
    computed_elsewhere(store, long)

    b = engine(store).engine
    b.add_request("stream", {"prompt_token_ids": stream}, SamplingParams(temperature=0, max_tokens=40,
                                                                          ignore_eos=True))
    for _ in range(2):
        b.step()
    b.add_request("long", {"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=4))
    b.step()
    assert b.core.scheduler.loading, "the load should be in flight"
    b.abort_request("long")
    for _ in range(100):  # bounded: until the load has ended and its blocks are back
        b.step()
        if not b.core.scheduler.loading:
            break
    assert not b.core.scheduler.loading and "long" not in b.core.kv_cache.req_blocks
    b.check_integrity()
    while b.has_unfinished_requests():  # the stream is unharmed
        b.step()
    b.check_integrity()
    b.core.close()


def test_a_copy_from_shared_memory_stays_in_the_step(arena):
    long, stream = prompt_of(200, seed=5), prompt_of(30, seed=6)
    computed_elsewhere(arena, long)
    b = engine(arena).engine
    b.add_request("stream", {"prompt_token_ids": stream}, SamplingParams(temperature=0, max_tokens=8))
    b.step()
    b.add_request("long", {"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=1))
    outs = b.step()  # loaded and computed in this very step
    assert not b.core.scheduler.loading
    [done] = [o for o in outs if o.request_id == "long"]
    assert done.finished and done.metrics.num_cached_tokens == (len(long) - 1) // BLOCK * BLOCK
    while b.has_unfinished_requests():
        b.step()
    b.check_integrity()
    b.core.close()
