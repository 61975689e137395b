"""Three kinds of fix for a deployment that misses its SLO, each simulated, ranked by what it gains.

  reconfigure      another TP x PP on the same GPUs (the roofline's two most promising, simulated)
  KV quantization  an fp8 KV cache: half the bytes per token, so twice the sequences per pool and half the
                   KV each decode step reads
  scheduling       a smaller token budget (shorter prefill chunks between decode steps), a larger
                   max_num_seqs, or splitting prefill from decode (PD at the roofline's P:D ratio)

Each action's effect is one unit simulated at its share of the QPS on the same GPUs ("after") against the
current deployment ("before"), and its goodput per GPU; actions rank by goodput per GPU, then attainment.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvbaton.config import SchedulerConfig
from kvbaton.plan.candidate import Candidate
from kvbaton.plan.deployment import DeploymentPlan
from kvbaton.plan.evaluate import Harness
from kvbaton.plan.search import Progress, at_target, candidate, pd_ratios
from kvbaton.sim.model_spec import KVDtype
from kvbaton.sim.roofline import Parallelism

RECONFIGURATIONS_SIMULATED = 2


class ActionKind(str, Enum):
    RECONFIGURE = "TP/PP re-configuration"
    KV_QUANTIZATION = "KV quantization"
    SCHEDULING = "scheduling parameters"


@dataclass(frozen=True, kw_only=True)
class Action:
    kind: ActionKind
    change: str
    result: Candidate  # the chosen variant, with its goodput and its at-target run
    tried: tuple[Candidate, ...]  # every variant simulated for this action
    notes: tuple[str, ...] = ()

    @property
    def rank_key(self) -> tuple[float, float]:
        attainment = self.result.at_target.attainment if self.result.at_target else 0.0
        return (-self.result.per_device, -attainment)


def propose_actions(harness: Harness, current: Candidate, devices: int, note: Progress) -> list[Action]:
    """The three actions, best first."""
    actions = [_reconfigure(harness, current, devices, note), _quantize_kv(harness, current, devices, note),
               _reschedule(harness, current, devices, note)]
    return sorted(actions, key=lambda a: a.rank_key)


def _simulate(harness: Harness, deps: list[DeploymentPlan], devices: int, note: Progress) -> list[Candidate]:
    return [at_target(harness, candidate(harness, dep, note), devices) for dep in deps]


def _best(tried: list[Candidate]) -> Candidate:
    return max(tried, key=lambda c: (c.per_device, c.at_target.attainment if c.at_target else 0.0))


def _reconfigure(harness: Harness, current: Candidate, devices: int, note: Progress) -> Action:
    dep, load = current.deployment, harness.load
    per_node = harness.setting.hardware.devices_per_node
    options = [dep.with_(parallel=Parallelism(tp, pp, dep.parallel.ep if dep.parallel.ep == 1 else tp))
               for tp in (1, 2, 4, 8) for pp in (1, 2)
               if tp <= per_node and tp * pp <= devices and (tp, pp) != (dep.parallel.tp, dep.parallel.pp)]
    fitting = [o for o in options if harness.setting.memory(o).fits(load.max_seq_len)]
    # NOTE: simulate only the roofline's most promising: its capacity per GPU ranks them well enough
    fitting.sort(key=lambda o: -harness.estimated_capacity(o) / o.unit_devices)
    tried = _simulate(harness, fitting[:RECONFIGURATIONS_SIMULATED], devices, note)
    best = _best(tried) if tried else current
    units = best.units_on(devices)
    change = f"{dep.parallel.label} -> {best.deployment.parallel.label} ({units} instances of " \
             f"{best.deployment.unit_devices} GPUs)"
    return Action(kind=ActionKind.RECONFIGURE, change=change, result=best, tried=tuple(tried))


def _quantize_kv(harness: Harness, current: Candidate, devices: int, note: Progress) -> Action:
    dep, load = current.deployment, harness.load
    fp8 = dep.with_(kv_dtype=KVDtype.FP8)
    tried = _simulate(harness, [fp8], devices, note)
    before, after = current.memory, tried[0].memory
    seqs_before, seqs_after = before.max_seqs(load.mean_seq_len), after.max_seqs(load.mean_seq_len)
    notes = (f"KV per token {before.kv_bytes_per_token / 1024:.0f} KiB -> {after.kv_bytes_per_token / 1024:.0f} KiB; "
             f"sequences of {load.mean_seq_len} tokens per instance {seqs_before} -> {seqs_after} "
             f"(+{seqs_after - seqs_before}); max_num_seqs {dep.scheduler.max_num_seqs} still caps the batch"
             if dep.scheduler.max_num_seqs < seqs_after else
             f"KV per token {before.kv_bytes_per_token / 1024:.0f} KiB -> {after.kv_bytes_per_token / 1024:.0f} KiB; "
             f"sequences per instance {seqs_before} -> {seqs_after}",
             "Accuracy: fp8 (e4m3) KV with per-tensor scales is usually close to fp16 on Llama-3-class models, "
             "but check your own evals (long contexts suffer first); kvbaton's own int8/fp8_e4m3 pools keep a "
             "scale per token and head (51.6% of fp16 at head_dim 128) and were measured in "
             "benchmarks/results/kv-quant.md.")
    return Action(kind=ActionKind.KV_QUANTIZATION, change=f"KV {dep.kv_dtype.value} -> fp8", result=tried[0],
                  tried=tuple(tried), notes=notes)


def _reschedule(harness: Harness, current: Candidate, devices: int, note: Progress) -> Action:
    dep = current.deployment
    sched = dep.scheduler
    variants = {
        f"max_num_batched_tokens {sched.max_num_batched_tokens} -> 2048 (shorter prefill chunks)":
            dep.with_(scheduler=SchedulerConfig(max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=2048)),
        f"max_num_seqs {sched.max_num_seqs} -> {sched.max_num_seqs * 2}":
            dep.with_(scheduler=SchedulerConfig(max_num_seqs=sched.max_num_seqs * 2,
                                                max_num_batched_tokens=sched.max_num_batched_tokens)),
    }
    if not dep.disaggregated:
        p, d = pd_ratios(harness, dep, 1)[0]
        variants[f"PD: {p} prefill : {d} decode instances of {dep.parallel.label}"] = \
            dep.with_(num_prefill=p, num_decode=d)
    tried = _simulate(harness, list(variants.values()), devices, note)
    best = _best(tried)
    change = next(label for label, v in variants.items() if v == best.deployment)
    return Action(kind=ActionKind.SCHEDULING, change=change, result=best, tried=tuple(tried),
                  notes=tuple(f"tried: {label}: {c.per_device:.3f} req/s per GPU"
                              for label, c in zip(variants, tried)))
