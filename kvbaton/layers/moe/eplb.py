"""Expert-parallel load balancing (EPLB): which physical slot, on which EP rank, holds each MoE expert.

The algorithm DeepSeek published for DeepSeek-V3 (deepseek-ai/EPLB), written here from its description: hot
experts get redundant replicas and the replicas are packed onto ranks so that every rank carries about the same
load. Hierarchical when the expert groups divide evenly over the nodes (groups stay on one node, so group-limited
routing keeps its traffic inside a node), global otherwise.

Pure Python, no torch: it runs between traffic windows on small inputs (layers x experts), and its outputs are
plain tuples that a torch caller turns into index tensors. Slot convention: physical slot p lives on rank
p // slots_per_rank, and rank r on node r // (num_ranks // num_nodes).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Literal

Objective = Literal["tokens", "active_experts"]


@dataclass(frozen=True, kw_only=True)
class ExpertPlacement:
    """One MoE layer's placement. `physical_to_logical[p]` is the expert slot p holds; `logical_to_physical[e]`
    lists expert e's slots in ascending order and `replica_counts[e]` is their number (always >= 1).
    Build one with `from_slots`; the constructor checks the three views agree."""

    physical_to_logical: tuple[int, ...]
    logical_to_physical: tuple[tuple[int, ...], ...]
    replica_counts: tuple[int, ...]
    num_ranks: int
    num_nodes: int = 1

    def __post_init__(self) -> None:
        _check_topology(len(self.physical_to_logical), len(self.logical_to_physical), self.num_ranks, self.num_nodes)
        if _invert(self.physical_to_logical, len(self.logical_to_physical)) != self.logical_to_physical:
            raise ValueError("logical_to_physical is not the inverse of physical_to_logical")
        if self.replica_counts != tuple(len(s) for s in self.logical_to_physical):
            raise ValueError("replica_counts disagree with logical_to_physical")
        if 0 in self.replica_counts:
            raise ValueError(f"expert {self.replica_counts.index(0)} has no replica")

    @classmethod
    def from_slots(
        cls, physical_to_logical: Sequence[int], *, num_logical: int, num_ranks: int, num_nodes: int = 1
    ) -> ExpertPlacement:
        """The placement whose slot p holds expert `physical_to_logical[p]`."""
        p2l = tuple(physical_to_logical)
        l2p = _invert(p2l, num_logical)
        counts = tuple(len(s) for s in l2p)
        return cls(physical_to_logical=p2l, logical_to_physical=l2p, replica_counts=counts,
                   num_ranks=num_ranks, num_nodes=num_nodes)

    @property
    def num_replicas(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_logical(self) -> int:
        return len(self.logical_to_physical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_replicas // self.num_ranks

    @property
    def max_replicas(self) -> int:
        return max(self.replica_counts)

    def rank_of_slot(self, slot: int) -> int:
        """The EP rank that physical slot `slot` lives on."""
        if not 0 <= slot < self.num_replicas:
            raise ValueError(f"slot {slot} outside [0, {self.num_replicas})")
        return slot // self.slots_per_rank

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Per rank, the load it carries when each expert's `load` is split evenly over its replicas
        (which is what the `replica_for` rule does on average)."""
        self._check_load(load)
        out = [0.0] * self.num_ranks
        for slot, e in enumerate(self.physical_to_logical):
            out[slot // self.slots_per_rank] += load[e] / self.replica_counts[e]
        return out

    def balancedness(self, load: Sequence[float]) -> float:
        """mean(rank_loads) / max(rank_loads): 1.0 is perfectly balanced, 1/num_ranks is all load on one rank.
        No load at all counts as balanced (1.0)."""
        loads = self.rank_loads(load)
        peak = max(loads)
        return 1.0 if peak == 0 else sum(loads) / len(loads) / peak

    def active_experts_per_rank(self, load: Sequence[float]) -> list[int]:
        """Per rank, the distinct experts it hosts whose load is > 0: in memory-bound decode each such expert's
        weights are read once per step, whatever its token count. (A replica is counted as hit whenever its
        expert is; with few tokens some replicas of a hot expert may actually stay idle.)"""
        self._check_load(load)
        hit: list[set[int]] = [set() for _ in range(self.num_ranks)]
        for slot, e in enumerate(self.physical_to_logical):
            if load[e] > 0:
                hit[slot // self.slots_per_rank].add(e)
        return [len(h) for h in hit]

    def replica_for(self, token_index: int, logical_expert: int) -> int:
        """The physical slot token `token_index` uses for `logical_expert`: replica token_index % replica_count.
        Deterministic and local (no communication), and it spreads a hot expert's tokens evenly."""
        if not 0 <= logical_expert < self.num_logical:
            raise ValueError(f"expert {logical_expert} outside [0, {self.num_logical})")
        slots = self.logical_to_physical[logical_expert]
        return slots[token_index % len(slots)]

    def replica_table(self) -> tuple[int, ...]:
        """`replica_for` as a flat table of num_logical * max_replicas slots, row e padded by repeating e's
        replicas, so a vectorised caller computes `table[e * max_replicas + token_index % replica_counts[e]]`.
        (The padding keeps every entry a valid slot, but only `% replica_counts[e]` spreads evenly.)"""
        width = self.max_replicas
        return tuple(slots[j % len(slots)] for slots in self.logical_to_physical for j in range(width))

    def _check_load(self, load: Sequence[float]) -> None:
        if len(load) != self.num_logical:
            raise ValueError(f"load has {len(load)} experts, the placement {self.num_logical}")


def replica_table(placement: ExpertPlacement) -> tuple[int, ...]:
    """Module-level form of `ExpertPlacement.replica_table`."""
    return placement.replica_table()


def identity_placement(num_logical: int, *, num_ranks: int, num_nodes: int = 1) -> ExpertPlacement:
    """Expert e in slot e, no replicas: the layout before any balancing."""
    return ExpertPlacement.from_slots(range(num_logical), num_logical=num_logical, num_ranks=num_ranks,
                                      num_nodes=num_nodes)


def moved_slots(previous: ExpertPlacement, new: ExpertPlacement) -> tuple[int, ...]:
    """The slots whose expert changed from `previous` to `new`: the weight copies the runtime must make."""
    if previous.num_replicas != new.num_replicas:
        raise ValueError(f"placements differ in size: {previous.num_replicas} vs {new.num_replicas} slots")
    return tuple(p for p, (a, b) in enumerate(zip(previous.physical_to_logical, new.physical_to_logical)) if a != b)


def balanced_packing(weights: Sequence[float], num_packs: int, tiebreak: Sequence[float] | None = None) -> list[int]:
    """Pack item i into pack `result[i]` so that every pack gets exactly len(weights) / num_packs items and the
    pack weights are close: heaviest item first, each into the lightest pack that still has room (greedy LPT
    with a capacity). `tiebreak` is a second weight balanced lexicographically after the first. Deterministic:
    equal keys go by lower item, then lower pack index."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    second = tiebreak if tiebreak is not None else [0.0] * n
    if len(second) != n:
        raise ValueError("tiebreak must have one entry per item")
    per_pack = n // num_packs
    heap = [(0.0, 0.0, p) for p in range(num_packs)]  # (weight, tiebreak, pack): the lightest pack with room on top
    filled = [0] * num_packs
    out = [0] * n
    for i in sorted(range(n), key=lambda i: (-weights[i], -second[i], i)):
        w, s, p = heapq.heappop(heap)
        out[i] = p
        filled[p] += 1
        if filled[p] < per_pack:  # a full pack leaves the heap for good
            heapq.heappush(heap, (w + weights[i], s + second[i], p))
    return out


def replicate(weights: Sequence[float], num_slots: int) -> list[int]:
    """Replica count per item, summing to `num_slots`, each >= 1: every extra slot goes to the item with the
    highest weight per replica (which minimises the largest per-replica weight). Ties: fewer replicas, then
    lower index, so spare slots over idle experts go round-robin."""
    if num_slots < len(weights):
        raise ValueError(f"{num_slots} slots cannot hold {len(weights)} experts")
    counts = [1] * len(weights)
    heap = [(-w, 1, i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(weights)):
        _, _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (-weights[i] / counts[i], counts[i], i))
    return counts


def rebalance(load: Sequence[Sequence[float]], previous: Sequence[ExpertPlacement] | None = None, *,
              num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
              objective: Objective = "tokens", keep_within: float = 0.0) -> list[ExpertPlacement]:
    """`rebalance_layer` for every MoE layer: `load` is per layer, per logical expert (tokens over a window),
    `previous` one placement per layer or None."""
    if not load:
        raise ValueError("load has no layers")
    if previous is not None and len(previous) != len(load):
        raise ValueError(f"previous has {len(previous)} layers, load {len(load)}")
    prev: Sequence[ExpertPlacement | None] = previous if previous is not None else [None] * len(load)
    return [rebalance_layer(row, p, num_replicas=num_replicas, num_groups=num_groups, num_nodes=num_nodes,
                            num_ranks=num_ranks, objective=objective, keep_within=keep_within)
            for row, p in zip(load, prev)]


def rebalance_layer(load: Sequence[float], previous: ExpertPlacement | None = None, *,
                    num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                    objective: Objective = "tokens", keep_within: float = 0.0) -> ExpertPlacement:
    """One layer's placement for `load`. Hierarchical (groups packed to nodes, replicas made per node, packed to
    the node's ranks) when num_groups % num_nodes == 0, global (one node) otherwise.

    With `previous`: balance is still decided by the packing alone, but among the equally balanced layouts of
    that packing (which node, rank and slot gets which pack) the one that moves the fewest weights is chosen, so
    rebalancing twice on the same load moves nothing. The greedy packing can still reshuffle a lot on a small
    load change; `keep_within` > 0 returns `previous` unchanged when its balancedness on `load` is within that
    much of the new plan's (and, for "active_experts", its busiest rank hits no more experts)."""
    _check_inputs(load, num_replicas, num_groups, num_nodes, num_ranks, objective)
    if not 0.0 <= keep_within <= 1.0:
        raise ValueError(f"keep_within must be in [0, 1], not {keep_within!r}")
    if previous is not None and (previous.num_replicas, previous.num_logical, previous.num_ranks,
                                 previous.num_nodes) != (num_replicas, len(load), num_ranks, num_nodes):
        raise ValueError("previous placement has another shape (slots, experts, ranks or nodes)")
    packs = _pack(load, num_replicas, num_groups, num_nodes, num_ranks, objective)
    slots = _arrange(packs, previous, num_replicas // num_ranks)
    fresh = ExpertPlacement.from_slots(slots, num_logical=len(load), num_ranks=num_ranks, num_nodes=num_nodes)
    if previous is not None and keep_within > 0 and _no_worse(previous, fresh, load, objective, keep_within):
        return previous
    return fresh


def _no_worse(old: ExpertPlacement, new: ExpertPlacement, load: Sequence[float], objective: Objective,
              slack: float) -> bool:
    """Whether `old` balances `load` within `slack` of `new`, so that keeping it (no weight copies) wins."""
    if objective == "active_experts" and max(old.active_experts_per_rank(load)) > max(
            new.active_experts_per_rank(load)):
        return False
    return old.balancedness(load) >= new.balancedness(load) - slack


def _pack(load: Sequence[float], num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
          objective: Objective) -> list[list[list[int]]]:
    """Per packing node, per rank in it, the experts its slots hold (a multiset, unordered yet)."""
    if num_groups % num_nodes:  # global policy: groups cannot stay whole on a node, so pack over one "node"
        num_groups = num_nodes = 1
    size = len(load) // num_groups
    groups = [range(g * size, (g + 1) * size) for g in range(num_groups)]
    # "active_experts" packs 1 per expert that gets any token, 0 otherwise: memory-bound decode reads each hit
    # expert's weights once however many tokens it gets, so the rank hitting the most experts sets the step time
    primary = list(load) if objective == "tokens" else [1.0 if x > 0 else 0.0 for x in load]
    node_of = balanced_packing([sum(primary[e] for e in g) for g in groups], num_nodes,
                               [sum(load[e] for e in g) for g in groups])
    out = []
    for node in range(num_nodes):
        experts = [e for g, grp in enumerate(groups) if node_of[g] == node for e in grp]
        # replicas always follow token load: a replica halves an expert's tokens per rank, not its weight reads
        counts = dict(zip(experts, replicate([load[e] for e in experts], num_replicas // num_nodes)))
        replicas = [e for e in experts for _ in range(counts[e])]
        share = [load[e] / counts[e] for e in replicas]
        # token load breaks ties under "active_experts" (for "tokens" it is the primary weight already)
        rank_of = balanced_packing([primary[e] / counts[e] if objective == "tokens" else primary[e]
                                    for e in replicas], num_ranks // num_nodes, share)
        out.append([[e for e, r in zip(replicas, rank_of) if r == k] for k in range(num_ranks // num_nodes)])
    return out


def _arrange(packs: list[list[list[int]]], previous: ExpertPlacement | None, slots_per_rank: int) -> list[int]:
    """Lay the packs out as physical slots. Nodes, ranks within a node and slots within a rank are each
    interchangeable for balance, so each level is matched to `previous` by overlap to keep weights in place."""
    if previous is None:
        return [e for node in packs for rank in node for e in sorted(rank)]
    ranks_per_pack = len(packs[0])
    old = previous.physical_to_logical
    old_ranks = [old[r * slots_per_rank:(r + 1) * slots_per_rank] for r in range(len(old) // slots_per_rank)]
    old_nodes = [old_ranks[n * ranks_per_pack:(n + 1) * ranks_per_pack] for n in range(len(packs))]
    node_to = _match([list(chain.from_iterable(n)) for n in packs], [list(chain.from_iterable(n)) for n in old_nodes])
    layout: list[list[int]] = [[] for _ in old_ranks]
    for i, node in enumerate(packs):
        base = node_to[i] * ranks_per_pack
        rank_to = _match(node, old_nodes[node_to[i]])
        for k, experts in enumerate(node):
            layout[base + rank_to[k]] = _keep_in_place(experts, old_ranks[base + rank_to[k]])
    return list(chain.from_iterable(layout))


def _match(new: Sequence[Sequence[int]], old: Sequence[Sequence[int]]) -> list[int]:
    """A one-to-one map new[i] -> old[result[i]], greedily pairing the largest multiset overlaps first.
    Overlaps are counted through an expert -> old positions index, so the cost is linear in the slots."""
    where: dict[int, list[tuple[int, int]]] = {}
    for j, xs in enumerate(old):
        for e, c in Counter(xs).items():
            where.setdefault(e, []).append((j, c))
    pairs: list[tuple[int, int, int]] = []
    for i, xs in enumerate(new):
        overlap: Counter[int] = Counter()
        for e, c in Counter(xs).items():
            for j, old_c in where.get(e, ()):
                overlap[j] += min(c, old_c)
        pairs.extend((-v, i, j) for j, v in overlap.items())
    out, taken = [-1] * len(new), [False] * len(old)
    for _, i, j in sorted(pairs):
        if out[i] < 0 and not taken[j]:
            out[i], taken[j] = j, True
    free = iter(j for j in range(len(old)) if not taken[j])  # packs sharing nothing with what is left
    return [j if j >= 0 else next(free) for j in out]


def _keep_in_place(experts: Sequence[int], old_slots: Sequence[int]) -> list[int]:
    """Order a rank's experts so each one the rank already held keeps its old slot; newcomers fill the rest."""
    remaining = Counter(experts)
    kept: list[int | None] = []
    for e in old_slots:
        kept.append(e if remaining[e] > 0 else None)
        if remaining[e] > 0:
            remaining[e] -= 1
    newcomers = iter(sorted(remaining.elements()))
    return [e if e is not None else next(newcomers) for e in kept]


def _invert(physical_to_logical: Sequence[int], num_logical: int) -> tuple[tuple[int, ...], ...]:
    """Each expert's slots, ascending; rejects slots naming an expert outside [0, num_logical)."""
    slots: list[list[int]] = [[] for _ in range(num_logical)]
    for p, e in enumerate(physical_to_logical):
        if not 0 <= e < num_logical:
            raise ValueError(f"slot {p} holds expert {e}, outside [0, {num_logical})")
        slots[e].append(p)
    return tuple(tuple(s) for s in slots)


def _check_topology(num_replicas: int, num_logical: int, num_ranks: int, num_nodes: int) -> None:
    if num_logical < 1 or num_ranks < 1 or num_nodes < 1:
        raise ValueError("num_logical, num_ranks and num_nodes must each be >= 1")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas ({num_replicas}) < num_logical experts ({num_logical})")
    if num_replicas % num_ranks:
        raise ValueError(f"num_replicas ({num_replicas}) is not a multiple of num_ranks ({num_ranks})")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) is not a multiple of num_nodes ({num_nodes})")


def _check_inputs(load: Sequence[float], num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                  objective: str) -> None:
    _check_topology(num_replicas, len(load), num_ranks, num_nodes)
    if num_groups < 1 or len(load) % num_groups:
        raise ValueError(f"num_logical experts ({len(load)}) is not a multiple of num_groups ({num_groups})")
    if objective not in ("tokens", "active_experts"):
        raise ValueError(f"objective must be 'tokens' or 'active_experts', not {objective!r}")
    bad = [x for x in load if not (math.isfinite(x) and x >= 0)]
    if bad:
        raise ValueError(f"loads must be finite and >= 0, got {bad[0]!r}")
