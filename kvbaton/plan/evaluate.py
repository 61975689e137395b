"""Simulate one unit of a deployment at a request rate, and find its goodput (DistServe's metric).

Goodput of a unit: the highest request rate at which at least `attainment_target` of the requests meet both
SLOs. Found by simulation: start from the roofline's estimate of the unit's capacity, widen until one rate
passes and one fails, then bisect. Every run replays the same requests (`RequestPool`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbaton.plan.deployment import DeploymentPlan, Setting
from kvbaton.plan.workload import RequestPool, Workload
from kvbaton.sim.latency import StepShape
from kvbaton.sim.simulator import simulate
from kvbaton.workload.metrics import good_count, summarize


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    window_s: float = 60.0  # simulated seconds of arrivals per run
    seed: int = 0
    search_steps: int = 5  # simulations per goodput search
    min_requests: int = 40  # per run, however low the rate
    max_requests: int = 1500  # per run: bounds the real time a high-rate run takes (shortens its window)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One simulated run of one unit."""

    rate: float  # requests/s into the unit
    num_requests: int
    attainment: float  # requests meeting both SLOs / every request sent
    goodput: float  # requests/s meeting both SLOs
    ttft_p99_ms: float
    tpot_p99_ms: float
    tpot_mean_ms: float
    e2e_mean_ms: float
    rejected: int
    preemptions: int
    peak_kv_usage: float  # the fullest instance of the unit
    mean_kv_usage: float
    mean_decode_batch: float
    busy: float  # the busiest instance's fraction of the run spent in steps
    mfu: float  # 2 x active params x tokens computed / (unit GPUs x dense peak x duration)
    wall_s: float


@dataclass(frozen=True, kw_only=True)
class Goodput:
    """A unit's goodput and the runs that found it."""

    rate: float  # requests/s per unit at the target attainment (0 if no rate tried met it)
    per_device: float
    best: Evaluation | None
    runs: tuple[Evaluation, ...]


@dataclass(frozen=True)
class RequestCost:
    """One request's share of an instance's time, by the roofline alone (no queueing)."""

    prefill_s: float  # its prompt, in steps of the full token budget
    decode_s: float  # its output tokens' share of decode steps at the largest batch that fits
    decode_batch: int


@dataclass(frozen=True)
class Harness:
    """What every simulation of one plan shares: the setting, the load, the options, the requests."""

    setting: Setting
    load: Workload
    options: SimOptions
    pool: RequestPool

    @classmethod
    def build(cls, setting: Setting, load: Workload, options: SimOptions) -> Harness:
        return cls(setting, load, options, load.pool(options.max_requests, options.seed))

    def evaluate(self, dep: DeploymentPlan, rate: float) -> Evaluation:
        load, options = self.load, self.options
        count = max(options.min_requests, min(options.max_requests, math.ceil(rate * options.window_s)))
        requests = self.pool.at(rate, count)
        # NOTE: a request still running this long after the last arrival has an E2E beyond what its SLOs allow
        # (TTFT + (n - 1) x TPOT), so cutting the run there changes no verdict; cut-off requests count as misses
        longest = max(r.output_len for r in requests)
        deadline = requests[-1].arrival_s + (load.slo_ttft_ms + (longest - 1) * load.slo_tpot_ms) / 1000 + 1.0
        run = simulate(self.setting.cluster(dep), requests, request_rate=rate, max_duration_s=deadline)
        summary = summarize(run.result, load.slo)
        duration = max(run.result.duration_s, 1e-9)
        good = good_count(run.result.records, load.slo)
        # every token an instance computed (prefill, decode, recomputation after preemption), finished or not
        tokens = sum(s.mean_batch_tokens * s.num_steps for s in run.instances)
        peak = self.setting.hardware.bf16_flops * dep.unit_devices * duration
        decoders = [s for s in run.instances if s.role != "prefill"]
        return Evaluation(
            rate=rate, num_requests=len(requests), attainment=good / len(requests), goodput=good / duration,
            ttft_p99_ms=_ms(summary.ttft_ms.p99), tpot_p99_ms=_ms(summary.tpot_ms.p99),
            tpot_mean_ms=_ms(summary.tpot_ms.mean), e2e_mean_ms=_ms(summary.e2e_ms.mean),
            rejected=summary.rejected, preemptions=sum(s.num_preemptions for s in run.instances),
            peak_kv_usage=max(s.peak_kv_usage for s in decoders), mean_kv_usage=max(s.mean_kv_usage for s in decoders),
            mean_decode_batch=max(s.mean_decode_batch for s in decoders),
            busy=max(s.busy_s for s in run.instances) / duration,
            mfu=tokens * 2.0 * self.setting.model.active_params / peak, wall_s=run.wall_s)

    def goodput(self, dep: DeploymentPlan) -> Goodput:
        runs: list[Evaluation] = []
        passed: Evaluation | None = None
        failed = math.inf
        rate = self.estimated_capacity(dep)
        for _ in range(self.options.search_steps):
            ev = self.evaluate(dep, rate)
            runs.append(ev)
            if ev.attainment >= self.load.attainment_target:
                passed = ev if passed is None or ev.rate > passed.rate else passed
            else:
                failed = min(failed, rate)
            low = passed.rate if passed else 0.0
            if math.isfinite(failed) and low and failed / low < 1.08:
                break
            rate = _next_rate(low, failed, rate)
        best = passed.rate if passed else 0.0
        return Goodput(rate=best, per_device=best / dep.unit_devices, best=passed, runs=tuple(runs))

    def request_cost(self, dep: DeploymentPlan) -> RequestCost:
        latency, memory, load = self.setting.latency(dep), self.setting.memory(dep), self.load
        budget = dep.scheduler.max_num_batched_tokens
        chunk = latency.step_seconds(StepShape(prefill_tokens=budget, prefill_seqs=1,
                                               prefill_attended=budget * load.mean_prompt_len // 2))
        batch = max(1, min(dep.scheduler.max_num_seqs, memory.max_seqs(load.mean_seq_len)))
        context = load.mean_prompt_len + load.output_len // 2
        step = latency.step_seconds(StepShape(decode_seqs=batch, decode_context=batch * context))
        return RequestCost(load.mean_prompt_len * chunk / budget, load.output_len * step / batch, batch)

    def estimated_capacity(self, dep: DeploymentPlan) -> float:
        """Requests/s a unit could sustain by the roofline alone (no queueing, no SLO): a starting point."""
        cost = self.request_cost(dep)
        if not dep.disaggregated:
            return 1.0 / (cost.prefill_s + cost.decode_s)
        return min(dep.num_prefill / cost.prefill_s, dep.num_decode / cost.decode_s)


def _ms(value: float | None) -> float:
    return math.inf if value is None else value


def _next_rate(passed: float, failed: float, last: float) -> float:
    if not math.isfinite(failed):
        return last * 1.5
    if passed == 0.0:
        return last * 0.6
    return math.sqrt(passed * failed)
