"""Per layer x expert token counts over a sliding window of steps: the input EPLB plans from.

The engine records, each step, how many tokens every MoE layer routed to each expert (`record`, once or several
times per layer and step: counts add up), then closes the step (`end_step`). The window keeps the last
`window_steps` closed steps in a ring preallocated at construction, so memory never grows: closing a step
subtracts the oldest step's counts from the running totals and reuses its buffer for the next
step. Pure Python, no threads, no globals: the owner serialises access.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypeAlias

from kvbaton.layers.moe.eplb import ExpertPlacement, identity_placement

# What `balancedness` / `snapshot` take: one placement per layer, one for every layer, or a rank count
# (meaning the identity placement: expert e on rank e // (num_experts / ranks), no replicas).
Placements: TypeAlias = Sequence[ExpertPlacement] | ExpertPlacement | int


class ExpertLoadWindow:
    """Token counts per (layer, expert) summed over the last `window_steps` closed steps."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int) -> None:
        if num_layers < 1 or num_experts < 1 or window_steps < 1:
            raise ValueError(f"num_layers ({num_layers}), num_experts ({num_experts}) and window_steps "
                             f"({window_steps}) must each be >= 1")
        self.num_layers, self.num_experts, self.window_steps = num_layers, num_experts, window_steps
        self._ring = [self._zeros() for _ in range(window_steps)]  # closed steps; slot i % window_steps: step i
        self._open = self._zeros()  # the step being recorded
        self._totals = self._zeros()  # sum of the ring
        self.total_steps = 0  # steps closed since construction

    @property
    def steps_recorded(self) -> int:
        """Closed steps the window currently covers (at most `window_steps`)."""
        return min(self.total_steps, self.window_steps)

    def record(self, layer: int, counts: Sequence[int]) -> None:
        """Add one step's token counts for `layer` (one non-negative integer per expert) to the open step."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        if len(counts) != self.num_experts:
            raise ValueError(f"counts has {len(counts)} entries, expected {self.num_experts} experts")
        try:  # operator.index accepts Python and numpy integers and rejects floats (a count of 1.5 is a bug)
            values = [operator.index(c) for c in counts]
        except TypeError as exc:
            raise ValueError(f"token counts must be integers: {exc}") from None
        if min(values) < 0:
            raise ValueError(f"token counts must be >= 0, got {min(values)}")
        row = self._open[layer]
        for e, c in enumerate(values):
            row[e] += c

    def end_step(self) -> None:
        """Close the open step: it enters the window and, once the window is full, the oldest step leaves it."""
        slot = self.total_steps % self.window_steps
        evicted = self._ring[slot]
        for total, old, new in zip(self._totals, evicted, self._open):
            for e in range(self.num_experts):
                total[e] += new[e] - old[e]
        self._ring[slot], self._open = self._open, evicted  # reuse the evicted buffer as the next open step
        for row in self._open:
            row[:] = [0] * self.num_experts
        self.total_steps += 1

    def totals(self) -> list[list[int]]:
        """Per layer, per expert, tokens over the closed steps in the window (a copy; the open step excluded)."""
        return [list(row) for row in self._totals]

    def hottest(self, k: int, layer: int | None = None) -> list[tuple[int, int, int]]:
        """The `k` (layer, expert, tokens) with the most tokens over the window, most first, ties by (layer,
        expert); across all layers, or only `layer`."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if layer is not None and not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        layers = range(self.num_layers) if layer is None else (layer,)
        cells = [(layer_, e, self._totals[layer_][e]) for layer_ in layers for e in range(self.num_experts)]
        return sorted(cells, key=lambda c: (-c[2], c[0], c[1]))[:k]

    def balancedness(self, placements: Placements) -> list[float]:
        """Per layer, `ExpertPlacement.balancedness` of the window's totals: mean / max rank load, 1.0 balanced."""
        return [p.balancedness(row) for p, row in zip(self._per_layer(placements), self._totals)]

    def snapshot(self, placements: Placements | None = None) -> dict[str, object]:
        """A JSON- (and msgspec-) serialisable view of the window, e.g. for `GET /experts`."""
        out: dict[str, object] = {
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "window_steps": self.window_steps,
            "steps_recorded": self.steps_recorded,
            "total_steps": self.total_steps,
            "counts": self.totals(),
        }
        if placements is not None:
            out["balancedness"] = self.balancedness(placements)
        return out

    def _per_layer(self, placements: Placements) -> list[ExpertPlacement]:
        if isinstance(placements, int):
            placements = identity_placement(self.num_experts, num_ranks=placements)
        if isinstance(placements, ExpertPlacement):
            placements = [placements] * self.num_layers
        if len(placements) != self.num_layers:
            raise ValueError(f"{len(placements)} placements for {self.num_layers} layers")
        if any(p.num_logical != self.num_experts for p in placements):
            raise ValueError(f"a placement does not cover {self.num_experts} experts")
        return list(placements)

    def _zeros(self) -> list[list[int]]:
        return [[0] * self.num_experts for _ in range(self.num_layers)]
