"""bench_moe_ep.py's rank processes: one engine per rank, every step timed, with the time inside the calls that
cross ranks (all-to-all, the lockstep all-reduce), the int8 codec and the local experts."""

from __future__ import annotations

import time
from typing import Any

from common.prompts import make_prompts
from moe_ep_bench.models import SHAPE


class Clock:
    """What one step spent where (this rank), from wrappers around the calls that cross ranks."""

    def __init__(self) -> None:
        self.a2a_s = self.allreduce_s = self.codec_s = self.experts_s = 0.0
        self.slots_hit = 0  # distinct local expert slots that computed rows, summed over the layers
        self.wire = {"rows": 0, "slot_ids": 0, "counts": 0}
        self.sched = (0, 0)

    def reset(self) -> None:
        self.__init__()


def install_timers(clock: Clock, rank: int, world: int) -> None:
    """Wrap torch.distributed's all_to_all_single / all_reduce, dispatch's int8 codec and the local expert call.
    Measurement only, in this process; kvbaton looks them up at call time, so it runs through the wrappers."""
    import torch.distributed as dist

    from kvbaton.layers.moe import dispatch

    real_a2a, real_reduce = dist.all_to_all_single, dist.all_reduce
    real_q, real_dq = dispatch.quantize_rows, dispatch.dequantize_rows
    real_local = dispatch.AllToAllDispatch._local_experts

    def all_to_all_single(*args, **kwargs):
        tensor, split = args[1], kwargs.get("input_split_sizes")
        if split is None:  # the per-rank row counts: an equal split
            clock.wire["counts"] += tensor.nbytes * (world - 1) // world
        else:
            row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 and tensor.shape[0] else 1)
            clock.wire["slot_ids" if tensor.dim() == 1 else "rows"] += (sum(split) - split[rank]) * row
        t = time.perf_counter()
        try:
            return real_a2a(*args, **kwargs)
        finally:
            clock.a2a_s += time.perf_counter() - t

    def all_reduce(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real_reduce(*args, **kwargs)
        finally:
            clock.allreduce_s += time.perf_counter() - t

    def timed(fn, field):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(clock, field, getattr(clock, field) + time.perf_counter() - t)
        return wrapper

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    dispatch.quantize_rows, dispatch.dequantize_rows = timed(real_q, "codec_s"), timed(real_dq, "codec_s")
    timed_local = timed(real_local, "experts_s")

    def local_experts(self, rows, local_slots):
        clock.slots_hit += int(local_slots.unique().numel())
        return timed_local(self, rows, local_slots)

    dispatch.AllToAllDispatch._local_experts = local_experts


def moe_kernel_layers(model) -> int:
    from kvbaton.layers.moe.experts import GroupedExperts

    return sum(getattr(m, "kernel", None) is not None for m in model.modules() if isinstance(m, GroupedExperts))


def record_steps(core: Any, clock: Clock, group: Any) -> list[list]:
    """Wrap the engine core's step (and its runner's execute, for the scheduled batch's shape) so that every step
    appends its record to the list returned: what the step scheduled, its wall time, the clock's times and the EP
    group's counters."""
    counters = (lambda: (group.bytes_sent, group.rows_computed)) if group is not None else (lambda: (0, 0))
    steps: list[list] = []
    real_step, real_execute = core.step, core.runner.execute

    def execute(sched):
        clock.sched = (sched.num_scheduled_tokens, len(sched.scheduled))
        return real_execute(sched)

    def step():
        clock.reset()
        b0, r0 = counters()
        t = time.perf_counter()
        res = real_step()
        wall = time.perf_counter() - t
        b1, r1 = counters()
        # [tokens, seqs, wall, a2a, all_reduce, codec, experts, bytes_sent, rows_computed, wire rows/ids/counts,
        #  slots hit]
        steps.append([*clock.sched, wall, clock.a2a_s, clock.allreduce_s, clock.codec_s, clock.experts_s, b1 - b0,
                      r1 - r0, clock.wire["rows"], clock.wire["slot_ids"], clock.wire["counts"], clock.slots_hit])
        return res

    core.step, core.runner.execute = step, execute
    return steps


def run_phase(llm: Any, job: dict, ph: dict, params: Any, steps: list[list], group: Any) -> dict:
    """One phase on this rank: its share of the phase's prompts, the steps they took (empty ones dropped) and
    their greedy outputs; the EP group rebalanced after it when the phase asks."""
    size, rank = job["size"], job["rank"]
    prompts = make_prompts(job["seed"], ph["tag"], ph["n"], ph["len"], SHAPE["vocab_size"])
    share = len(prompts) // size
    mine = prompts[rank * share:(rank + 1) * share]
    steps.clear()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in mine], params)
    rec = {"name": ph["name"], "tag": ph["tag"], "kind": ph["kind"], "wall_s": time.perf_counter() - t,
           "steps": [list(s) for s in steps if s[0] > 0],
           "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    if ph.get("rebalance_after"):
        assert group is not None, "EPLB needs an EP group"
        t = time.perf_counter()
        group.rebalance_now()
        rec["rebalance_s"] = time.perf_counter() - t
    return rec


def rank_main(job: dict) -> dict:
    """One rank of a group, in its own process: the engine (EP over gloo when the group has more than one rank),
    the job's phases, and the EP group's totals."""
    from kvbaton import LLM, SamplingParams
    from kvbaton.config import ExpertParallelConfig

    size, rank = job["size"], job["rank"]
    clock = Clock()
    install_timers(clock, rank, size)
    ep = None if size == 1 else ExpertParallelConfig(
        size=size, rank=rank, init_method=f"tcp://127.0.0.1:{job['port']}", int8_dispatch=job["int8"],
        num_redundant_experts=job["redundant"], timeout_s=job["collective_timeout_s"])
    t0 = time.perf_counter()
    # NOTE: single decode steps for EP1 too (EP ranks never burst): each timed engine step is one model step
    llm = LLM(job["model"], dtype="bfloat16", num_threads=job["threads"], max_model_len=1024,
              kv_cache_memory_gb=0.25, expert_parallel=ep, decode_burst=1)
    init_s = time.perf_counter() - t0
    core = llm.engine.core
    group = core.expert_parallel
    model = core.runner.model
    kernel_layers = moe_kernel_layers(model)
    steps = record_steps(core, clock, group)
    phases = [run_phase(llm, job, ph, SamplingParams(temperature=0, max_tokens=ph["max_tokens"], ignore_eos=True),
                        steps, group) for ph in job["phases"]]
    res = {"rank": rank, "init_s": init_s, "compute_path": llm.engine.info.compute_path,
           "moe_kernel_layers": kernel_layers, "moe_kernel_layers_end": moe_kernel_layers(model), "phases": phases}
    if group is not None:
        res.update(bytes_sent=group.bytes_sent, rows_computed=group.rows_computed,
                   rebalances=group.rebalancer.rebalances,
                   layer0_slots_end=list(group.rebalancer.expert_map(0).local_experts(rank)))
        group.close()
    return res
