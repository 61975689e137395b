"""`--afd-micro-batches auto`: an attention worker's micro-batch count per decode step, chosen from how fast its
own steps ran with each count (the ping-pong of `models/ping_pong.py`).

What m is best depends on the attention time, the experts' time and the exchange's cost, each a function of the
micro-batch's size, and on how the machines are loaded right now; the step's wall time sums all of it. So the
chooser measures rather than models: per batch-size bucket (rows rounded up to a power of two) it tries each
count `tries` times, then takes the one with the lowest time per row (a moving average), and now and then tries
another again so that a change in load or placement is noticed. Output does not depend on m (each micro-batch
is a slice of the rows), so exploring costs time, never correctness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 3, 4)
SMOOTHING = 0.2  # weight of the newest step in a count's moving average


@dataclass
class _Bucket:
    seconds_per_row: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    since_retry: int = 0
    retries: int = 0  # which other count the next retry tries
    best: int | None = None


@dataclass
class MicroBatchChooser:
    candidates: tuple[int, ...] = CANDIDATES
    tries: int = 2  # steps per count before the first choice
    retry_every: int = 64  # then one step of another count every this many steps of a bucket
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    @staticmethod
    def bucket_of(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def pick(self, rows: int) -> int:
        """The micro-batch count for a decode step of `rows` rows."""
        counts = [m for m in self.candidates if m <= rows] or [1]
        b = self._buckets.setdefault(self.bucket_of(rows), _Bucket())
        untried = [m for m in counts if b.steps.get(m, 0) < self.tries]
        if untried:
            return min(untried, key=lambda m: b.steps.get(m, 0))
        best = min(counts, key=lambda m: b.seconds_per_row[m])
        b.since_retry += 1
        others = [m for m in counts if m != best]
        if others and b.since_retry >= self.retry_every:
            b.since_retry = 0
            b.retries += 1
            return others[b.retries % len(others)]
        return best

    def record(self, rows: int, micro_batches: int, seconds: float) -> None:
        """A decode step of `rows` rows ran as `micro_batches` micro-batches in `seconds`."""
        key = self.bucket_of(rows)
        b = self._buckets.setdefault(key, _Bucket())
        per_row = seconds / max(rows, 1)
        old = b.seconds_per_row.get(micro_batches)
        b.seconds_per_row[micro_batches] = per_row if old is None else old + SMOOTHING * (per_row - old)
        b.steps[micro_batches] = b.steps.get(micro_batches, 0) + 1
        tried = [m for m in b.seconds_per_row if b.steps[m] >= self.tries]
        best = min(tried, key=lambda m: b.seconds_per_row[m]) if tried else None
        if best is not None and best != b.best and len(tried) == len([m for m in self.candidates if m <= rows] or [1]):
            b.best = best
            logger.info("AFD micro-batches: %d for decode steps of up to %d rows (ms per row: %s)", best, key,
                        ", ".join(f"m={m} {b.seconds_per_row[m] * 1e3:.3f}" for m in sorted(b.seconds_per_row)))

    def choices(self) -> dict[int, int]:
        """bucket (rows up to) -> the count chosen so far (buckets still trying every count are left out)."""
        return {key: b.best for key, b in sorted(self._buckets.items()) if b.best is not None}
