"""The simulator runs the real scheduler: given the same requests at the same steps, a simulated instance
makes exactly the decisions the real engine (a real model, real forward passes) makes, step for step:
which requests run, how many tokens each computes from which position, who is preempted, who finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton import LLM
from kvbaton.config import SchedulerConfig
from kvbaton.engine.core import EngineCore
from kvbaton.sched.outputs import SchedulerOutput
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.sim.instance import ArrivalClock, SimInstance, sim_request
from kvbaton.sim.latency import LinearLatency
from kvbaton.sim.spec import InstanceSpec
from tests.support.helpers import tiny_prompts

Decision = tuple[tuple[tuple[str, int, int, bool], ...], frozenset[str], frozenset[str]]


def decision(sched: SchedulerOutput) -> Decision:
    scheduled = tuple((s.request_id, len(s.token_ids), s.start_position, s.sample) for s in sched.scheduled)
    return scheduled, sched.preempted_request_ids, sched.finished_request_ids


# Waves of requests: (step at which they arrive, prompt lengths, output lengths). A shared first prompt
# (wave 2 repeats wave 0's prompts) exercises prefix-cache hits; the small pool forces preemptions.
WAVES = [(0, [40, 9, 77, 23], [12, 20, 6, 30]), (3, [5, 64, 31], [25, 8, 14]), (9, [40, 9, 50], [10, 22, 18])]


def wave_requests() -> list[tuple[int, str, list[int], int]]:
    out, shared = [], {}
    for w, (step, lengths, outputs) in enumerate(WAVES):
        prompts = tiny_prompts(100 + w, lengths)
        for i, (prompt, n_out) in enumerate(zip(prompts, outputs)):
            prompt = shared.setdefault(len(prompt), prompt) if w != 1 else prompt  # equal lengths: same prompt
            out.append((step, f"w{w}-{i}", prompt, n_out))
    return out


def real_decisions(core: EngineCore) -> list[Decision]:
    record: list[Decision] = []
    schedule = core.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:  # the real method, its result written down
        sched = schedule()
        record.append(decision(sched))
        return sched

    core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    pending = wave_requests()
    step = 0
    while pending or core.scheduler.has_unfinished():
        for _, rid, prompt, n_out in [p for p in pending if p[0] <= step]:
            params = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
            core.add_request(core.new_request(rid, prompt, params))
        pending = [p for p in pending if p[0] > step]
        core.step()
        step += 1
    return record


def simulated_decisions(spec: InstanceSpec) -> list[Decision]:
    inst = SimInstance("both-0", "both", spec)
    clock = ArrivalClock()
    record: list[Decision] = []
    pending = wave_requests()
    step = 0
    while pending or inst.scheduler.has_unfinished():
        for _, rid, prompt, n_out in [p for p in pending if p[0] <= step]:
            inst.add(sim_request(rid, tuple(prompt), n_out, clock.stamp(step)))
        pending = [p for p in pending if p[0] > step]
        started = inst.start_step()
        record.append(decision(started.sched) if started else ((), frozenset(), frozenset()))
        if started:
            inst.end_step()
        step += 1
    inst.scheduler.check_integrity()
    return record


@pytest.mark.parametrize("chunked", [True, False])
def test_simulated_instance_schedules_exactly_as_the_real_engine(tiny_models: dict[str, Path], chunked: bool) -> None:
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48 if chunked else 96,
                            enable_chunked_prefill=chunked)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", block_size=4, num_blocks=40,
              max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
              enable_chunked_prefill=chunked)
    core = llm.engine.core
    real = real_decisions(core)
    spec = InstanceSpec(latency=LinearLatency(base_s=0.01), num_blocks=core.kv_cache.pool.num_blocks, block_size=4,
                        scheduler=sched, max_model_len=core.info.max_model_len)
    simulated = simulated_decisions(spec)
    assert core.scheduler.num_preemptions > 0, "the scenario should preempt"
    assert core.kv_cache.prefix_cache_stats().hit_tokens > 0, "the scenario should hit the prefix cache"
    assert simulated == real
