"""`GET /experts`: the pool's expert load (routed tokens per MoE layer and expert over each worker's window,
summed) and, per expert-parallel group, where its experts sit and how evenly its ranks share the work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbaton.layers.moe.eplb import ExpertPlacement
from kvbaton.sched.info import ExpertLoad


def expert_view(loads: Mapping[str, ExpertLoad], groups: Mapping[str, str]) -> dict[str, Any] | None:
    """`loads`: each live worker's; `groups`: worker name -> its EP group. None for a dense model."""
    if not loads:
        return None
    total = ExpertLoad.total(list(loads.values()))
    assert total is not None
    members: dict[str, list[str]] = {}
    for name in loads:
        members.setdefault(groups.get(name, name), []).append(name)
    return {"layers": list(total.layers), "window_steps": total.window_steps,
            "tokens": [list(row) for row in total.counts],
            "hottest": _hottest(total, 8),
            "workers": [_worker(name, load, groups.get(name)) for name, load in loads.items()],
            "groups": [_group(group, [loads[n] for n in names]) for group, names in members.items()
                       if loads[names[0]].ep_size > 1]}


def _worker(name: str, load: ExpertLoad, group: str | None) -> dict[str, Any]:
    view: dict[str, Any] = {"name": name, "steps": load.steps, "tokens": sum(map(sum, load.counts))}
    if load.ep_size > 1:
        view.update(ep_group=group, ep_rank=load.ep_rank, ep_size=load.ep_size, rows_computed=load.rows_computed,
                    bytes_sent=load.bytes_sent, rebalances=load.rebalances)
    return view


def _group(name: str, ranks: list[ExpertLoad]) -> dict[str, Any]:
    """A group's placement (as the rank that saw the most rebalances reports it: every rank swaps in the same
    step, but a report may be older) and, per layer, mean / max expected tokens per rank for the group's own
    load (1.0: even)."""
    load = ExpertLoad.total(ranks)
    assert load is not None
    lead = max(ranks, key=lambda r: (r.rebalances, -r.ep_rank))
    placements = [ExpertPlacement.from_slots(slots, num_logical=len(row), num_ranks=lead.ep_size)
                  for slots, row in zip(lead.placement, load.counts)]
    return {"ep_group": name, "ep_size": lead.ep_size, "ranks_reporting": len(ranks),
            "rebalances": lead.rebalances, "placement": [list(p) for p in lead.placement],
            "balancedness": [round(p.balancedness(row), 4) for p, row in zip(placements, load.counts)]}


def _hottest(load: ExpertLoad, k: int) -> list[dict[str, int]]:
    cells = [(tokens, layer, expert) for i, (layer, row) in enumerate(zip(load.layers, load.counts))
             for expert, tokens in enumerate(row)]
    return [{"layer": layer, "expert": expert, "tokens": tokens} for tokens, layer, expert in
            sorted(cells, reverse=True)[:k] if tokens]


def every_expert_served(experts: set[int], workers: list[tuple[list[int], dict[int, list[int]]]]) -> bool:
    """Whether expert workers (each: the experts its hello named, every layer alike, and the per-layer placement
    its last heartbeat said, {} before one) hold every one of `experts` in every MoE layer: by each worker's
    heartbeat where it has one (EPLB places each layer on its own), else by its hello."""
    layers = {layer for _, owns in workers for layer in owns} or {-1}
    for layer in layers:
        served = {e for hello, owns in workers for e in (owns[layer] if layer in owns else hello)}
        if not experts <= served:
            return False
    return True
