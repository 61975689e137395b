"""Why a running deployment misses its SLO: its memory math, the concurrency its load needs, and a simulation.

Given the deployment as it runs (TP x PP, dtypes, scheduler limits, GPU count) and its load, compute:
  - one token's KV (the formula with its numbers), one request's, the weights and KV pool per GPU;
  - the sequences an instance can hold (KV pool, and max_num_seqs) against what Little's law says the load
    keeps in flight per instance (its QPS share x E2E latency);
  - the compute the load asks for against what the GPUs give, and a decode step's arithmetic intensity
    against the machine balance (below it a step waits on memory, not on the SMs);
  - a simulation of one instance at its share of the QPS (the "before"), and its goodput.
`explain` turns those figures into the report's findings; nothing in it is fixed in advance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbaton.plan.candidate import Candidate
from kvbaton.plan.deployment import DeploymentPlan
from kvbaton.plan.evaluate import Evaluation, Harness
from kvbaton.plan.memory import MemoryPlan
from kvbaton.plan.search import Progress, at_target, candidate
from kvbaton.sim.latency import StepShape
from kvbaton.sim.model_spec import ModelSpec
from kvbaton.sim.roofline import StepCosts


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What the operator measured on the running deployment (None: not measured)."""

    tpot_p99_ms: float | None = None
    memory_used: float | None = None  # fraction of device memory in use
    sm_active: float | None = None  # fraction of time SMs had work (DCGM's SM active)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    current: Candidate  # with its goodput and its at-target run (the "before")
    devices: int
    observation: Observation
    kv_formula: str
    tokens_per_request: int  # prompt + output: what one finished request holds in the KV cache
    weight_bytes_total: float
    num_instances: int
    qps_per_instance: float
    e2e_at_slo_s: float  # the longest E2E a request meeting both SLOs can have
    decode_batch: int  # the batch the instance can run: min(max_num_seqs, what the KV pool holds)
    decode_costs: StepCosts  # a decode step at that batch
    decode_intensity: float  # its FLOPs per byte read (per GPU)
    machine_balance: float
    prefill_flops_needed: float  # per second, the whole load
    flops_available: float  # per second, the whole deployment at the assumed MFU, PP stages in turn

    @property
    def memory(self) -> MemoryPlan:
        return self.current.memory

    @property
    def before(self) -> Evaluation:
        assert self.current.at_target is not None
        return self.current.at_target

    @property
    def max_seqs_kv(self) -> int:
        return self.memory.max_seqs(self.tokens_per_request)

    @property
    def needed_at_slo(self) -> float:
        return self.qps_per_instance * self.e2e_at_slo_s

    @property
    def needed_simulated(self) -> float:
        return self.qps_per_instance * self.before.e2e_mean_ms / 1000


def kv_formula(model: ModelSpec, kv_bytes: int, element_bytes: int, scale_bytes: int) -> str:
    scale = f" + {scale_bytes} B scale" if scale_bytes else ""
    if model.mla is not None:
        m = model.mla
        return (f"{model.num_layers} layers x ({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} rope dims) x "
                f"{element_bytes} B{scale} = {kv_bytes:,} B = {kv_bytes / 1024:.1f} KiB per token")
    per_head = f"({model.head_dim} head_dim x {element_bytes} B{scale})" if scale else \
        f"{model.head_dim} head_dim x {element_bytes} B"
    return (f"2 (K and V) x {model.num_layers} layers x {model.num_kv_heads} KV heads x {per_head} = "
            f"{kv_bytes:,} B = {kv_bytes / 1024:.1f} KiB per token")


def diagnose(harness: Harness, current: DeploymentPlan, devices: int, observation: Observation,
             note: Progress) -> Diagnosis:
    setting, load = harness.setting, harness.load
    model, hw = setting.model, setting.hardware
    found = at_target(harness, candidate(harness, current, note), devices)
    units = found.units_on(devices)
    memory = found.memory
    batch = max(1, min(current.scheduler.max_num_seqs, memory.max_seqs(load.mean_seq_len)))
    latency = setting.latency(current)
    decode = StepShape(decode_seqs=batch, decode_context=batch * (load.mean_prompt_len + load.output_len // 2))
    prompt_flops = 2.0 * model.active_params + model.attention_flops_per_position(decode=False) * (
        load.mean_prompt_len + 1) / 2
    kv_dtype = current.kv_dtype
    return Diagnosis(
        current=found, devices=devices, observation=observation,
        kv_formula=kv_formula(model, memory.kv_bytes_per_token, kv_dtype.element_bytes, kv_dtype.scale_bytes),
        weight_bytes_total=model.weight_bytes(current.weight_dtype), num_instances=units,
        qps_per_instance=load.qps / max(units, 1),
        e2e_at_slo_s=(load.slo_ttft_ms + (load.output_len - 1) * load.slo_tpot_ms) / 1000,
        decode_batch=batch, decode_costs=latency.costs(decode),
        decode_intensity=latency.step_flops(decode) / current.parallel.tp / latency.step_bytes_per_device(decode),
        machine_balance=hw.machine_balance,
        prefill_flops_needed=load.qps * load.mean_prompt_len * prompt_flops,
        flops_available=units * (current.num_prefill + current.num_decode) * current.parallel.tp
        * hw.achieved_flops(current.weight_dtype),
        tokens_per_request=load.mean_seq_len)


def explain(d: Diagnosis) -> list[str]:
    """The findings, each a sentence built from the figures (so a different load reads differently)."""
    b, dep = d.before, d.current.deployment
    limit = min(dep.scheduler.max_num_seqs, d.max_seqs_kv)
    out = [_concurrency(d, limit)]
    ratio = d.prefill_flops_needed / d.flops_available
    out.append(f"Compute: prefilling {d.prefill_flops_needed / 1e15:.1f} PFLOP/s of prompts needs {ratio:.0%} of "
               f"the {d.flops_available / 1e15:.1f} PFLOP/s the {d.devices} GPUs give at the assumed MFU "
               + ("(PP stages run in turn, so each instance computes at the rate of one stage's GPUs)"
                  if dep.parallel.pp > 1 else "") + ("; the load is beyond what this deployment can prefill."
                                                     if ratio > 1 else "."))
    bound = "memory-bandwidth-bound" if d.decode_intensity < d.machine_balance else "compute-bound"
    c = d.decode_costs
    out.append(f"Decode: a step of {d.decode_batch} sequences does {d.decode_intensity:.0f} FLOP per byte read "
               f"against a machine balance of {d.machine_balance:.0f}: {bound} (compute {c.compute_s * 1e3:.1f} ms, "
               f"memory {c.memory_s * 1e3:.1f} ms, communication {c.comm_s * 1e3:.1f} ms per step)"
               + (", so during decode the SMs mostly wait on HBM: a bigger batch is the lever, and "
                  f"{_batch_cap(d)} caps it." if bound.startswith("memory") else "."))
    if dep.parallel.pp > 1:
        idle = (dep.parallel.pp - 1) / dep.parallel.pp
        out.append(f"PP={dep.parallel.pp}: a step passes the stages one after another, so each GPU idles {idle:.0%} "
                   "of every step (no micro-batch overlap modelled) while still holding its share of the KV.")
    out.append(f"Simulated before ({d.num_instances} instances at {d.qps_per_instance:.1f} QPS each): TPOT p99 "
               f"{b.tpot_p99_ms:.0f} ms, TTFT p99 {_s(b.ttft_p99_ms)}, SLO attainment {b.attainment:.0%}, KV pool "
               f"peak {b.peak_kv_usage:.0%} (mean {b.mean_kv_usage:.0%}), {b.preemptions} preemptions, "
               f"{b.rejected} of {b.num_requests} refused by admission control, MFU {b.mfu:.0%}, busiest "
               f"instance busy {b.busy:.0%} of the time (each of its GPUs {b.busy / dep.parallel.pp:.0%}).")
    out.extend(_against_observation(d))
    return out


def _batch_cap(d: Diagnosis) -> str:
    scheduler = d.current.deployment.scheduler
    if scheduler.max_num_seqs < d.max_seqs_kv:
        return f"max_num_seqs ({scheduler.max_num_seqs}, below the KV pool's {d.max_seqs_kv})"
    return f"the KV pool ({d.max_seqs_kv} sequences, below max_num_seqs {scheduler.max_num_seqs})"


def _concurrency(d: Diagnosis, limit: int) -> str:
    scheduler = d.current.deployment.scheduler
    capped = "max_num_seqs" if scheduler.max_num_seqs < d.max_seqs_kv else "the KV pool"
    verdict = "more than" if d.needed_at_slo > limit else "within"
    return (f"Little's law: {d.qps_per_instance:.1f} QPS per instance x {d.e2e_at_slo_s:.1f} s E2E at the SLO "
            f"limit = {d.needed_at_slo:.0f} sequences in flight ({d.needed_simulated:.0f} at the simulated mean E2E "
            f"of {d.before.e2e_mean_ms / 1000:.1f} s), {verdict} the {limit} an instance runs at once (capped by "
            f"{capped}: KV pool {d.max_seqs_kv}, max_num_seqs {scheduler.max_num_seqs}).")


def _against_observation(d: Diagnosis) -> list[str]:
    obs, b, out = d.observation, d.before, []
    if obs.tpot_p99_ms is not None:
        agree = "reproduces" if b.tpot_p99_ms > obs.tpot_p99_ms else "does NOT reproduce"
        out.append(f"Observed TPOT p99 > {obs.tpot_p99_ms:.0f} ms: the simulation {agree} it "
                   f"({b.tpot_p99_ms:.0f} ms).")
    if obs.memory_used is not None:
        taken = d.current.deployment.gpu_memory_utilization
        out.append(f"Observed memory {obs.memory_used:.0%} full: the engine takes {taken:.0%} of each GPU at start "
                   f"(weights {d.memory.weight_bytes / 1e9:.1f} GB, KV pool {d.memory.kv_pool_bytes / 1e9:.1f} GB), "
                   f"so device memory reads full whatever the load; in the simulation the pool itself peaks at "
                   f"{b.peak_kv_usage:.0%}.")
    if obs.sm_active is not None:
        agree = "consistent with" if b.mfu <= obs.sm_active * 1.5 else "higher than"
        out.append(f"Observed SM active {obs.sm_active:.0%}: the simulated MFU is {b.mfu:.0%}, {agree} it (SM active "
                   "counts any resident warp, so it reads above MFU; a much higher simulated figure means the "
                   "simulated load does more prefill work than the real one did, e.g. real prompts shared "
                   "prefixes or fewer requests reached the GPUs).")
    return out


def _s(ms: float) -> str:
    return "n/a" if math.isinf(ms) else f"{ms / 1000:.1f} s"
