"""Which deployment serves the load best: every TP x PP that fits, colocated and as P:D units, by goodput per GPU.

Colocated instances are tried at every fitting TP x PP (and EP = TP for MoE models); P:D units only on the
`num_pd_bases` best colocated parallelisms, at the P:D ratios nearest the roofline's prefill-to-decode time
ratio (a unit whose prefill and decode instances are equally busy). The recommendation is the highest goodput
per GPU, and the GPUs the target QPS then needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from kvbaton.config import ConfigError
from kvbaton.plan.candidate import Candidate
from kvbaton.plan.deployment import DeploymentPlan
from kvbaton.plan.disaggregation import DisaggregationAdvice, recommend_disaggregation
from kvbaton.plan.evaluate import Harness
from kvbaton.sim.roofline import Parallelism

MAX_UNIT_INSTANCES = 5  # P + D per unit
Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    tps: tuple[int, ...] = (1, 2, 4, 8)
    pps: tuple[int, ...] = (1, 2)
    try_ep: bool = True  # MoE models: also EP = TP with attention-DP
    disaggregation: bool = True
    pd_ratios: tuple[tuple[int, int], ...] = ()  # (): the ratios nearest the roofline's balance
    num_pd_ratios: int = 2
    num_pd_bases: int = 1
    device_budget: int | None = None  # GPUs available: the best are also simulated at qps / (budget // unit)
    num_at_target: int = 3  # how many of the best to simulate at the target QPS on the budget


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    harness: Harness
    candidates: tuple[Candidate, ...]  # best goodput per GPU first; those that do not fit last
    recommended: Candidate | None
    disaggregation: DisaggregationAdvice | None
    device_budget: int | None


def search(harness: Harness, base: DeploymentPlan, space: SearchSpace, progress: Progress | None = None) -> PlanResult:
    note = progress or (lambda _: None)
    colocated = [candidate(harness, dep, note) for dep in _colocated(harness, base, space)]
    ranked = sorted((c for c in colocated if c.fits), key=lambda c: -c.per_device)
    if not ranked:
        raise ConfigError(f"{harness.setting.model.name} ({base.weight_dtype.value}) fits in no configuration of "
                          f"{harness.setting.hardware.name} tried (TP {_csv(space.tps)}, PP {_csv(space.pps)}): "
                          f"no room for one {harness.load.max_seq_len}-token sequence beside the weights")
    pd: list[Candidate] = []
    if space.disaggregation:
        for base_c in ranked[:space.num_pd_bases]:
            for p, d in space.pd_ratios or pd_ratios(harness, base_c.deployment, space.num_pd_ratios):
                dep = base_c.deployment.with_(num_prefill=p, num_decode=d)
                if space.device_budget is None or dep.unit_devices <= space.device_budget:
                    pd.append(candidate(harness, dep, note))
    everything = sorted(colocated + pd, key=lambda c: (not c.fits, -c.per_device))
    everything = _with_targets(harness, everything, space, note)
    best_pd = max(pd, key=lambda c: c.per_device, default=None)
    return PlanResult(harness=harness, candidates=tuple(everything),
                      recommended=next((c for c in everything if c.per_device > 0), None),
                      disaggregation=recommend_disaggregation(harness, ranked[0], best_pd),
                      device_budget=space.device_budget)


def candidate(harness: Harness, dep: DeploymentPlan, note: Progress) -> Candidate:
    memory = harness.setting.memory(dep)
    if not memory.fits(harness.load.max_seq_len):
        note(f"{dep.label}: does not fit")
        return Candidate(deployment=dep, memory=memory, goodput=None)
    goodput = harness.goodput(dep)
    note(f"{dep.label}: goodput {goodput.rate:.2f} req/s per unit, {goodput.per_device:.3f} per GPU "
         f"({len(goodput.runs)} runs)")
    return Candidate(deployment=dep, memory=memory, goodput=goodput)


def at_target(harness: Harness, c: Candidate, devices: int) -> Candidate:
    """`c` with one unit simulated at its share of the target QPS on `devices` GPUs."""
    units = c.units_on(devices)
    if not c.fits or units < 1:
        return c
    return replace(c, at_target=harness.evaluate(c.deployment, harness.load.qps / units))


def _with_targets(harness: Harness, ranked: list[Candidate], space: SearchSpace, note: Progress) -> list[Candidate]:
    if space.device_budget is None:
        return ranked
    out = []
    for i, c in enumerate(ranked):
        if i < space.num_at_target:
            c = at_target(harness, c, space.device_budget)
            if c.at_target:
                note(f"{c.deployment.label} at {harness.load.qps:g} QPS on {space.device_budget} GPUs: "
                     f"attainment {c.at_target.attainment:.0%}")
        out.append(c)
    return out


def _colocated(harness: Harness, base: DeploymentPlan, space: SearchSpace) -> Iterator[DeploymentPlan]:
    per_node = harness.setting.hardware.devices_per_node
    for tp in space.tps:
        for pp in space.pps:
            if tp > per_node or (space.device_budget is not None and tp * pp > space.device_budget):
                continue
            yield base.with_(parallel=Parallelism(tp, pp), num_prefill=0, num_decode=1)
            if space.try_ep and harness.setting.model.moe is not None and tp > 1:
                yield base.with_(parallel=Parallelism(tp, pp, ep=tp), num_prefill=0, num_decode=1)


def pd_ratios(harness: Harness, dep: DeploymentPlan, count: int = 3) -> list[tuple[int, int]]:
    """The `count` P:D ratios (P + D <= MAX_UNIT_INSTANCES) nearest the roofline's prefill : decode time."""
    cost = harness.request_cost(dep)
    balance = cost.prefill_s / cost.decode_s
    ratios = [(p, d) for p in range(1, MAX_UNIT_INSTANCES) for d in range(1, MAX_UNIT_INSTANCES + 1 - p)
              if math.gcd(p, d) == 1]
    return sorted(ratios, key=lambda r: (abs(math.log(r[0] / r[1] / balance)), r[0] + r[1]))[:count]


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))
