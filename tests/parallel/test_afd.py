"""Attention/FFN disaggregation across processes: an attention engine whose MoE layers' routed experts live in a
pool of expert worker processes gives the colocated engine's greedy fp32 output, for tiny Mixtral, Qwen3-MoE and
DeepSeek-V3 (latent attention, shared experts, a dense first layer), over pools of one and two expert workers
and two attention engines sharing one pool, with the decode steps split into 1 to 4 ping-pong micro-batches, the
rows going through same-host shared memory or (Mixtral) inside the signed frames."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvbaton import LLM
from kvbaton.config import AttentionFFNConfig, ModelConfig
from kvbaton.parallel.afd.client import ExpertPoolError
from kvbaton.wire import SECRET_ENV
from tests.support.helpers import TINY_VOCAB, build_deepseek_checkpoint, greedy
from tests.support.wait import wait_until

MAX_NEW = 8
SECRET = "afd-test-secret-0123456789abcdef"


def _prompts(count: int, seed: int = 11) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


@contextmanager
def expert_pool(model: Path, size: int, monkeypatch: pytest.MonkeyPatch, redundant: int = 0,
                procs: list[subprocess.Popen] | None = None, encrypt: bool = False) -> Iterator[list[str]]:
    """`size` expert worker processes over `model` (into `procs`); their exchange addresses; stopped (by PID)
    at the end."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    procs = procs if procs is not None else []
    procs += [subprocess.Popen([sys.executable, "-m", "kvbaton.parallel.afd.standalone",
                                json.dumps({"model": str(model), "rank": r, "size": size, "redundant": redundant,
                                            "encrypt": encrypt})],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for r in range(size)]
    try:
        addresses = []
        for proc in procs:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.stderr.read()[-3000:]  # type: ignore[union-attr]
            addresses.append(json.loads(line)["address"])
        yield addresses
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def afd_models(tiny_moe_models, tmp_path_factory):
    return {"mixtral": tiny_moe_models["mixtral"], "qwen3_moe": tiny_moe_models["qwen3_moe"],
            "deepseek_v3": build_deepseek_checkpoint(tmp_path_factory.mktemp("afd-deepseek") / "deepseek_v3")}


@pytest.fixture(scope="module")
def colocated(afd_models):
    prompts = _prompts(6)
    return prompts, {arch: greedy(LLM(str(model), dtype="float32", num_threads=1, block_size=4), MAX_NEW, prompts)
                     for arch, model in afd_models.items()}


def _attention(model: Path, experts: list[str], index: int = 0, micro_batches: int = 1,
               shared_memory: bool = True, encrypt: bool = False, timeout_s: float = 30,
               rebalance_interval_steps: int = 0, **engine) -> LLM:
    afd = AttentionFFNConfig(experts=tuple(experts), index=index, micro_batches=micro_batches, timeout_s=timeout_s,
                             shared_memory=shared_memory, encrypt=encrypt,
                             rebalance_interval_steps=rebalance_interval_steps)
    return LLM(str(model), dtype="float32", num_threads=1, block_size=4, attention_ffn=afd, **engine)


def _with_micro_batches(llm: LLM, m: int) -> LLM:
    llm.engine.core.runner.model.micro_batches = m  # the same deployment, another split per step
    return llm


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_afd_matches_colocated_for_every_micro_batch_count(arch, afd_models, colocated, monkeypatch):
    prompts, refs = colocated
    # mixtral's rows go in signed frames on CURVE-encrypted sockets (the cross-host path), the others' in shm
    shared = arch != "mixtral"
    with expert_pool(afd_models[arch], 2, monkeypatch, encrypt=not shared) as experts:
        if not shared:  # a plain client cannot even say hello to an encrypted expert worker
            with pytest.raises(ExpertPoolError, match="refused the handshake|did not answer"):
                _attention(afd_models[arch], experts, shared_memory=False, timeout_s=1)
        llm = _attention(afd_models[arch], experts, shared_memory=shared, encrypt=not shared)
        for m in (1, 2, 3, 4):
            assert greedy(_with_micro_batches(llm, m), MAX_NEW, prompts) == refs[arch], f"m={m}"
        pool = llm.engine.core.expert_pool
        assert pool.stats.exchanges > 0
        assert pool.shared_memory == pool.local_channels == [shared, shared]


def test_one_expert_worker_and_two_attention_engines_share_it(afd_models, colocated, monkeypatch, tmp_path):
    prompts, refs = colocated
    model = afd_models["qwen3_moe"]
    with expert_pool(model, 1, monkeypatch) as experts:
        # m = 2, its steps traced; auto
        first = _attention(model, experts, 0, 2, step_trace_dir=str(tmp_path))
        second = _attention(model, experts, 1, 0)
        assert greedy(first, MAX_NEW, prompts[:3]) == refs["qwen3_moe"][:3]
        first.engine.core.step_trace.close()
        steps = [json.loads(line) for path in tmp_path.glob("steps-*.jsonl") for line in path.read_text().splitlines()]
        afd = [(s["shape"], s["afd"]) for s in steps[1:]]
        # every step's bubble is traced; decode steps in 2 micro-batches (1 for a lone sequence), prompts whole
        assert afd and all(0 <= a["attention_bubble"] <= 1 and a["wait_s"] >= 0 for _, a in afd)
        assert all(a["micro_batches"] == (1 if shape["prefill_tokens"] else min(2, shape["decode_seqs"]))
                   for shape, a in afd)
        assert any(a["micro_batches"] == 2 for _, a in afd)
        assert greedy(second, MAX_NEW, prompts[3:]) == refs["qwen3_moe"][3:]
        # auto tried each count its 3-row decode steps allow (1, 2, 3) and settled on one
        assert list(second.engine.core.micro_batch_chooser.choices()) == [4]


def test_a_dead_expert_worker_s_experts_are_served_by_their_copies(afd_models, colocated, monkeypatch):
    """Redundant experts in the pool (every expert on two of its workers): once an expert worker is gone, the
    attention engine routes its experts' rows to their copies and decodes on, with no replacement."""
    prompts, refs = colocated
    model = afd_models["qwen3_moe"]
    num_experts = ModelConfig.from_dir(model).moe.num_experts
    procs: list[subprocess.Popen] = []
    with expert_pool(model, 2, monkeypatch, redundant=num_experts, procs=procs) as experts:
        llm = _attention(model, experts, micro_batches=2)
        assert greedy(llm, MAX_NEW, prompts[:3]) == refs["qwen3_moe"][:3]
        pool = llm.engine.core.expert_pool
        assert pool.down == frozenset()
        procs[1].kill()
        procs[1].wait(30)
        # the dropped connection shows on the client's monitor socket within moments
        wait_until(lambda: pool.down == {1}, 10.0, interval_s=0.01, message=lambda: f"down: {pool.down}")
        assert greedy(llm, MAX_NEW, prompts[3:]) == refs["qwen3_moe"][3:]


def test_an_eplb_rebalance_mid_stream_keeps_every_token(afd_models, colocated, monkeypatch):
    """EPLB in the expert pool: attention engine 0 plans every 2 busy steps from the load the expert workers
    served (both engines' traffic), the expert workers load the moved experts while serving, and both engines
    switch placement between steps, mid-stream, with transformers' tokens throughout."""
    prompts, refs = colocated
    model = afd_models["qwen3_moe"]
    with expert_pool(model, 2, monkeypatch, redundant=2) as experts:  # 10 slots: copies of 2 hot experts
        leader = _attention(model, experts, 0, 2, rebalance_interval_steps=2)
        follower = _attention(model, experts, 1, 1)
        pool, behind = leader.engine.core.expert_pool, follower.engine.core.expert_pool
        first = pool.maps
        assert greedy(follower, MAX_NEW, prompts[3:]) == refs["qwen3_moe"][3:]

        def decodes_right(llm: LLM, until) -> bool:
            """Decode (every call checked against transformers) until `until()`: the expert workers load a
            placement in the background, so how many steps it takes depends on the machine's load."""
            assert greedy(llm, MAX_NEW, prompts) == refs["qwen3_moe"]
            return until()

        # a switch only happens between two steps of a run: always mid-stream, requests in flight
        wait_until(lambda: decodes_right(leader, lambda: pool.rebalances >= 1), 120.0, interval_s=0.01,
                   message="the leader never switched to a placement of its own")
        assert pool.epoch >= 1 and pool.maps != first
        hot = [layer for layer, m in pool.maps.items() if len(set(m.physical_to_logical)) == 8]
        assert hot == sorted(pool.maps), "every layer still covers every expert"
        # the follower catches up (its answers say the pool moved on) and decodes the same at the new placement
        wait_until(lambda: decodes_right(follower, lambda: behind.epoch >= pool.epoch), 120.0, interval_s=0.01,
                   message="the follower never caught up")
        assert behind.rebalances >= 1
