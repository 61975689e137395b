"""EPLB in the expert pool (attention/FFN disaggregation): attention worker 0 plans, the expert workers move.

Every `interval_steps` busy steps the leader asks each expert worker how many rows it computed per layer and
logical expert (`LoadQuery`: the pool's whole load, every attention worker's traffic, not only the leader's),
takes the window since its last plan, and places the experts as expert parallelism does
(`layers.moe.eplb.rebalance`: copies of hot experts in the pool's redundant slots, balanced over the workers,
moving as few experts as that balance allows). It hands the placement to every expert worker as the next
epoch (`PlaceExperts`); each loads its new slots on a thread of its own and keeps serving. Every attention worker,
the leader included, switches between two of its steps once every expert worker says it holds the epoch
(`ExpertPoolClient.between_steps`); until then its rows go out at the old epoch, which the expert workers keep
serving (`shard.RETAIN_S`). Nothing waits: no request stops for a rebalance.

    leader:   LoadQuery ─▶ every expert worker ─▶ window ─▶ plan ─▶ PlaceExperts(epoch + 1) ─▶ every one
    expert:   load new slots (thread) ─▶ answers say ready = epoch + 1
    everyone: all ready? ─▶ welcomes (the new slots) ─▶ route at epoch + 1
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.layers.moe.dispatch import ExpertMap
from kvbaton.layers.moe.eplb import ExpertPlacement, Objective, rebalance


@dataclass
class PoolBalancer:
    interval_steps: int
    num_experts: int
    num_groups: int = 1
    objective: Objective = "tokens"
    busy_steps: int = 0
    _seen: dict[int, list[list[int]]] = field(default_factory=dict)  # per expert worker: its counts at the last plan

    def due(self) -> bool:
        """Count a busy step; whether it is time to plan."""
        self.busy_steps += 1
        return self.busy_steps % self.interval_steps == 0

    def window(self, counts: list[list[list[int]]]) -> list[list[int]]:
        """Per layer and logical expert, the rows the pool computed since the last plan, from each expert worker's
        running counts (a replacement's start again from zero: what it counted is its window)."""
        load = [[0] * self.num_experts for _ in counts[0]] if counts else []
        for worker, now in enumerate(counts):
            before = self._seen.get(worker)
            for layer, row in enumerate(now):
                old = before[layer] if before is not None and len(before) == len(now) else [0] * len(row)
                for expert, (n, o) in enumerate(zip(row, old, strict=True)):
                    load[layer][expert] += n - o if n >= o else n
            self._seen[worker] = now
        return load

    def plan(self, load: list[list[int]], maps: list[ExpertMap]) -> list[list[int]] | None:
        """The next placement (per layer, the logical expert of every slot of the pool), or None when the window
        is empty or the plan moves nothing."""
        if not any(any(row) for row in load):
            return None
        size = maps[0].num_ranks
        previous = [ExpertPlacement.from_slots(m.physical_to_logical, num_logical=self.num_experts, num_ranks=size)
                    for m in maps]
        planned = rebalance(load, previous, num_replicas=len(maps[0].physical_to_logical), num_groups=self.num_groups,
                            num_nodes=1, num_ranks=size, objective=self.objective)
        placement = [list(p.physical_to_logical) for p in planned]
        if placement == [list(m.physical_to_logical) for m in maps]:
            return None
        return placement
