"""Scheduler, driven step by step with a token-id "model" instead of torch.

`TokenModel` writes each scheduled token id into a paged store addressed by the step's
block ids and predicts the next token from what it reads back, so a wrong block table,
a stale prefix-cache hit or a lost token changes the output."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbaton.config import SchedulerConfig
from kvbaton.sched.kv_cache_manager import KVCacheManager
from kvbaton.sched.outputs import EngineCoreOutput, ModelOutput, SchedulerOutput
from kvbaton.sched.request import Request, RequestStatus
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.sched.scheduler import Scheduler

BS = 4  # block size
Predict = Callable[[str, list[int]], int]


def next_token(request_id: str, context: list[int]) -> int:
    """Deterministic in the whole context; never 0..9, which tests use as eos / stop ids."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 7 + len(context)) % 89 + 10


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token("", prompt + out))
    return out


class TokenModel:
    def __init__(self, num_blocks: int, predict: Predict = next_token) -> None:
        self.store: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.predict = predict

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        for item in sched.scheduled:  # like KV writes: all of a step's tokens land before any read
            for pos, token in enumerate(item.token_ids, item.start_position):
                self.store[item.block_ids[pos // BS]][pos % BS] = token
        sampled = {}
        for item in sched.scheduled:
            if item.sample:
                end = item.start_position + item.num_tokens
                tokens: list[int] = []
                for _ in range(sched.decode_steps):  # a burst: each step writes the token the one before sampled
                    if tokens:
                        self.store[item.block_ids[end // BS]][end % BS] = tokens[-1]
                        end += 1
                    context = [self.store[item.block_ids[p // BS]][p % BS] for p in range(end)]
                    tokens.append(self.predict(item.request_id, context))
                sampled[item.request_id] = tokens
        return ModelOutput(sampled)


class Harness:
    def __init__(self, num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16,
                 threshold: int = 0, max_model_len: int = 1024, caching: bool = True,
                 predict: Predict = next_token, decode_burst: int = 1) -> None:
        config = SchedulerConfig(max_num_seqs, budget, True, threshold, decode_burst)
        self.sched = Scheduler(config, KVCacheManager(num_blocks, BS, caching), max_model_len)
        self.model = TokenModel(num_blocks, predict)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, EngineCoreOutput] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int | None = 8, priority: int = 0,
            arrival: float = 0.0, eos: tuple[int, ...] = (), **params) -> Request:
        req = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos,
                      priority=priority, arrival_time=arrival)
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        sched = self.sched.schedule()
        config = self.sched.config
        assert sched.num_scheduled_tokens == sum(s.num_tokens for s in sched.scheduled) <= config.max_num_batched_tokens
        assert len(sched.scheduled) <= config.max_num_seqs and self.sched.num_running <= config.max_num_seqs
        for out in self.sched.update_from_output(sched, self.model.execute(sched)):
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finished[out.request_id] = out
        self.sched.check_integrity()
        self.history.append(sched)
        return sched

    def run(self, max_steps: int = 500) -> dict[str, list[int]]:
        while self.sched.has_unfinished():
            self.step()
            assert len(self.history) < max_steps, "scheduler made no progress"
        self.sched.check_integrity()
        assert self.sched.kv_cache.pool.usage() == 0.0, "blocks still referenced after all requests finished"
        return self.outputs


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 17) % 97 + 10 for i in range(n)]


WORKLOAD = [(f"r{i}", prompt(i, n), m) for i, (n, m) in enumerate([(5, 9), (13, 4), (8, 12), (21, 6), (3, 10)])]


def test_outputs_match_the_reference_model() -> None:
    h = Harness()
    for rid, p, m in WORKLOAD:
        h.add(rid, p, m)
    assert h.run() == {rid: reference(p, m) for rid, p, m in WORKLOAD}
    assert all(h.finished[rid].finish_reason == "length" for rid, _, _ in WORKLOAD)


@pytest.mark.parametrize(("threshold", "chunks"), [(0, [16, 16, 16, 2]), (6, [6] * 8 + [2])])
def test_token_budget_is_respected_and_long_prompts_are_chunked(threshold: int, chunks: list[int]) -> None:
    h = Harness(budget=16, threshold=threshold)
    h.add("long", prompt(1, 50), max_tokens=3)
    h.run()
    assert [s.scheduled[0].num_tokens for s in h.history] == chunks + [1, 1]
    assert [s.scheduled[0].sample for s in h.history] == [False] * (len(chunks) - 1) + [True] * 3
    assert h.outputs["long"] == reference(prompt(1, 50), 3)


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    h = Harness(budget=8)
    h.add("short", prompt(1, 4), max_tokens=10)
    h.step()
    h.add("long", prompt(2, 100), max_tokens=2, arrival=1.0)
    while "short" not in h.finished:
        sched = h.step()
        assert sched.scheduled[0].request_id == "short" and sched.scheduled[0].num_tokens == 1
        assert sum(s.num_tokens for s in sched.scheduled) == 8  # the prefill takes the rest
    h.run()
    assert h.outputs == {"short": reference(prompt(1, 4), 10), "long": reference(prompt(2, 100), 2)}


def test_max_num_seqs_limits_the_running_batch() -> None:
    h = Harness(max_num_seqs=2)
    for rid, p, m in WORKLOAD:
        h.add(rid, p, m)
    h.run()
    assert max(len(s.scheduled) for s in h.history) == 2
    assert h.outputs == {rid: reference(p, m) for rid, p, m in WORKLOAD}


@pytest.mark.parametrize("concurrent", [True, False])
def test_prefix_cache_hits_skip_shared_blocks(concurrent: bool) -> None:
    shared = prompt(1, 12)
    first, second = shared + prompt(2, 3), shared + prompt(3, 5)
    h = Harness()
    h.add("first", first)
    if not concurrent:
        h.run()
    h.add("second", second, arrival=1.0)  # same step: hits blocks cached at allocation
    h.run()
    start = next(s for sched in h.history for s in sched.scheduled if s.request_id == "second")
    assert start.start_position == 12 and start.token_ids == second[12:]
    assert h.finished["second"].num_cached_tokens == 12
    assert h.outputs == {"first": reference(first, 8), "second": reference(second, 8)}


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_complete_with_the_same_tokens(caching: bool) -> None:
    h = Harness(num_blocks=10, budget=32, caching=caching)
    for i, (rid, p, m) in enumerate(WORKLOAD):
        h.add(rid, p, m + 6, arrival=float(i))
    assert h.run() == {rid: reference(p, m + 6) for rid, p, m in WORKLOAD}
    preempted = set().union(*(s.preempted_request_ids for s in h.history))
    assert h.sched.num_preemptions >= len(preempted) > 0
    assert "r0" not in preempted  # the victim is the latest arrival, never the oldest running request


def test_waiting_requests_are_admitted_fcfs_then_by_priority() -> None:
    h = Harness(max_num_seqs=1)
    h.add("late", prompt(1, 4), max_tokens=2, arrival=3.0)
    h.add("early", prompt(2, 4), max_tokens=2, arrival=1.0)
    h.add("urgent", prompt(3, 4), max_tokens=2, arrival=5.0, priority=-1)
    h.add("middle", prompt(4, 4), max_tokens=2, arrival=2.0)
    h.run()
    assert list(h.finished) == ["urgent", "early", "middle", "late"]


def test_lower_priority_running_request_is_preempted_first() -> None:
    h = Harness(num_blocks=6, budget=64)
    h.add("background", prompt(1, 8), max_tokens=12, priority=1, arrival=0.0)
    h.add("foreground", prompt(2, 8), max_tokens=12, priority=0, arrival=1.0)
    h.run()
    preempted = set().union(*(s.preempted_request_ids for s in h.history))
    assert preempted == {"background"}
    assert list(h.finished) == ["foreground", "background"]
    assert h.outputs["background"] == reference(prompt(1, 8), 12)


def test_abort_frees_blocks_immediately() -> None:
    h = Harness(budget=8, max_num_seqs=1)
    running = h.add("running", prompt(1, 12), max_tokens=20)
    waiting = h.add("waiting", prompt(2, 6), max_tokens=20, arrival=1.0)
    h.step()
    assert h.sched.kv_cache.block_ids("running")
    h.sched.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert h.sched.kv_cache.pool.usage() == 0.0 and not h.sched.has_unfinished()
    assert running.finish_reason == waiting.finish_reason == "abort"
    h.sched.check_integrity()
    sched = h.step()
    assert sched.is_empty and sched.finished_request_ids == {"running", "waiting"}
    h.sched.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)  # twice is harmless


def scripted(tokens: list[int], prompt_len: int) -> Predict:
    return lambda request_id, context: tokens[len(context) - prompt_len]


@pytest.mark.parametrize(("params", "want", "reason", "stop_reason"), [
    ({}, [11, 12, 2], "stop", None),  # eos
    ({"stop_token_ids": [12]}, [11, 12], "stop", 12),
    ({"max_tokens": 2}, [11, 12], "length", None),
    ({"ignore_eos": True}, [11, 12, 2, 13, 2, 14], "length", None),
    ({"min_tokens": 4}, [11, 12, 2, 13, 2], "stop", None),
    ({"min_tokens": 4, "stop_token_ids": [11]}, [11, 12, 2, 13, 2], "stop", None),
    ({"ignore_eos": True, "stop_token_ids": [2]}, [11, 12, 2], "stop", 2),
])
@pytest.mark.parametrize("decode_burst", [1, 4])
def test_stop_conditions(params: dict, want: list[int], reason: str, stop_reason: int | None,
                         decode_burst: int) -> None:
    """Within a decode burst too, a request stops at the token that stops it (the rest computed is dropped)."""
    p = prompt(1, 5)
    h = Harness(predict=scripted([11, 12, 2, 13, 2, 14, 15, 16, 17, 18], len(p)), decode_burst=decode_burst)
    h.add("a", p, **{"max_tokens": 6, "temperature": 0.0, **params}, eos=(2,))
    h.run()
    assert h.outputs["a"] == want
    assert (h.finished["a"].finish_reason, h.finished["a"].stop_reason) == (reason, stop_reason)


@pytest.mark.parametrize("decode_burst", [1, 3])
def test_max_model_len_ends_a_request_without_max_tokens(decode_burst: int) -> None:
    h = Harness(max_model_len=9, decode_burst=decode_burst)
    h.add("a", prompt(1, 5), max_tokens=None, temperature=0.0)
    h.run()
    assert h.outputs["a"] == reference(prompt(1, 5), 4)
    assert h.finished["a"].finish_reason == "length"


@pytest.mark.parametrize("decode_burst", [1, 4])
def test_a_request_alone_in_a_full_pool_ends_instead_of_preempting_itself(decode_burst: int) -> None:
    h = Harness(num_blocks=3, max_model_len=1024, decode_burst=decode_burst)
    h.add("a", prompt(1, 5), max_tokens=None, temperature=0.0)
    h.run()
    assert len(h.outputs["a"]) == 3 * BS - 5 and h.sched.num_preemptions == 0


def test_decode_bursts_give_the_same_tokens_and_run_only_while_no_one_waits() -> None:
    """Greedy decodes burst 4 steps at a time (their slots taken ahead, none past max_tokens); a request that
    arrives stops the bursts until it is admitted; a request that samples keeps its batch to single steps."""
    h = Harness(decode_burst=4)
    for rid, p, m in WORKLOAD[:3]:
        h.add(rid, p, m, temperature=0.0)
    for _ in range(3):
        h.step()
    late = h.add("late", prompt(9, 6), max_tokens=9, temperature=0.0, arrival=1.0)
    assert h.step().decode_steps == 1 and late.status == RequestStatus.RUNNING  # admitted, not held back
    h.run()
    assert h.outputs == {**{rid: reference(p, m) for rid, p, m in WORKLOAD[:3]}, "late": reference(prompt(9, 6), 9)}
    bursts = [s.decode_steps for s in h.history]
    assert max(bursts) == 4 and len(h.history) < sum(m for _, _, m in WORKLOAD[:3])
    sampling = Harness(decode_burst=4)
    sampling.add("greedy", prompt(1, 5), 9, temperature=0.0)
    sampling.add("random", prompt(2, 5), 9)  # temperature 1: the sampler runs each step
    sampling.run()
    assert {s.decode_steps for s in sampling.history} == {1}


def test_scheduler_module_imports_no_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    # torch made unimportable: the scheduler (and what it imports) must not need it
    code = "import sys\nsys.modules['torch'] = None\nimport kvbaton.sched.scheduler\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
