"""Fetch or recompute: measured seconds per block of each tier against measured prefill speed.

Each tier's cost is an exponentially weighted mean of the seconds its loads took (a failed load
counts its time too, so a stalled tier prices itself out). Until a tier has been measured it is
assumed cheap, and a tier not used for REPROBE_S is assumed cheap again, so a tier that was slow
once gets measured again instead of being shunned forever. No torch here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

ALPHA = 0.2  # weight of the newest sample
REPROBE_S = 30.0


class _Mean:
    def __init__(self) -> None:
        self.value: float | None = None
        self.updated = 0.0

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - ALPHA) * self.value + ALPHA * sample
        self.updated = time.monotonic()

    def current(self) -> float | None:
        if self.value is not None and time.monotonic() - self.updated > REPROBE_S:
            self.value = None
        return self.value


class LoadCosts:
    def __init__(self, num_tiers: int) -> None:
        self._tier_s = [_Mean() for _ in range(num_tiers)]  # seconds per block loaded from tier i
        self._token_s = _Mean()  # seconds per prefill token

    def note_load(self, tier: int, seconds: float, num_blocks: int = 1) -> None:
        self._tier_s[tier].add(seconds / max(num_blocks, 1))

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self._token_s.add(seconds / num_tokens)

    def tier_seconds(self, tier: int) -> float | None:
        return self._tier_s[tier].current()

    @property
    def token_seconds(self) -> float | None:
        return self._token_s.current()

    def worth_loading(self, sources: Sequence[int], block_size: int) -> int:
        """How many of the leading blocks to load, block i coming from tier `sources[i]`: the longest
        prefix whose estimated load time is no more than recomputing its tokens would take."""
        token_s = self.token_seconds
        if token_s is None:
            return len(sources)  # nothing measured yet: load, and measure
        best = load_s = compute_s = 0.0
        n_best = 0
        for n, tier in enumerate(sources, 1):
            load_s += self.tier_seconds(tier) or 0.0
            compute_s += token_s * block_size
            if load_s <= compute_s and compute_s - load_s >= best:
                best, n_best = compute_s - load_s, n
        return n_best
