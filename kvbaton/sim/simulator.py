"""The discrete-event loop: arrivals, engine steps, KV handoffs, in simulated time.

(Implementation in progress; the API below is fixed.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbaton.bench.records import RunResult
from kvbaton.sim.spec import ClusterSpec, SimRequest


@dataclass(frozen=True, kw_only=True)
class InstanceStats:
    """What one simulated instance did over the run."""

    name: str
    role: str  # "both" | "prefill" | "decode"
    num_steps: int
    busy_s: float  # simulated seconds spent in steps
    num_preemptions: int
    peak_kv_usage: float  # fraction of the pool's blocks in use, at its fullest
    mean_kv_usage: float  # time-weighted over the run
    mean_batch_tokens: float  # tokens per step
    mean_decode_batch: float  # decoding sequences per step that had any


@dataclass(frozen=True, kw_only=True)
class SimRun:
    result: RunResult  # the same records `kvbaton bench serve` produces: summarize() them
    instances: tuple[InstanceStats, ...]
    counters: dict[str, int]  # routing: disaggregated, local, refused_receives, rejected
    wall_s: float  # real seconds the simulation took


def simulate(cluster: ClusterSpec, requests: Sequence[SimRequest], *, request_rate: float = float("inf"),
             max_duration_s: float | None = None) -> SimRun:
    """Run `requests` (arrival times in simulated seconds) through `cluster`; deterministic.

    `request_rate` only labels the result (as the bench's RunResult does); `max_duration_s`
    cancels what is still in flight that long after the first arrival."""
    raise NotImplementedError
