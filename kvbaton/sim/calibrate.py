"""Calibrate what serving adds (`HostOverhead`) on one measured run, so the simulator answers for the served stack.

Two figures, taken from one `kvbaton bench serve` run against a server started with `--step-trace`:

    each role's served steps  ◀─ measured: the trace's steps over the profile's prediction for their
                                 shapes, and the pauses between them (kvbaton.sim.served_steps)
    the dispatch delay        ◀─ the one figure fitted: measured TTFT p50 - the replay's TTFT p50 with those
                                 steps (a delay every request pays alike moves TTFT one for one and
                                 changes no schedule)

TPOT is not fitted at all, and tails and other loads stay out of it, so validating on them tests the
model, not the fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvbaton.bench.metrics import Summary
from kvbaton.sim.host import HostOverhead, ServedSteps


@dataclass(frozen=True, kw_only=True)
class Calibration:
    host: HostOverhead
    measured_ttft_p50_ms: float
    measured_tpot_p50_ms: float
    simulated_ttft_p50_ms: float  # with `host`
    simulated_tpot_p50_ms: float
    engines_ttft_p50_ms: float  # with no host overhead: what the figures had to explain
    engines_tpot_p50_ms: float


def calibrate(simulate_with: Callable[[HostOverhead], Summary], *, roles: Mapping[str, ServedSteps],
              measured_ttft_p50_ms: float, measured_tpot_p50_ms: float, label: str = "") -> Calibration:
    """The host overhead of the measured run that `simulate_with` replays: `roles` as measured from its step trace,
    and the dispatch delay that brings the replay's TTFT median to the measured one (at least 0)."""
    if not (measured_ttft_p50_ms > 0 and measured_tpot_p50_ms > 0):
        raise ValueError("calibration needs a measured run with a positive TTFT and TPOT median")
    engines = _medians(simulate_with(HostOverhead()))
    stepped = _medians(simulate_with(HostOverhead(roles=dict(roles))))
    dispatch_s = max(0.0, (measured_ttft_p50_ms - stepped[0]) / 1e3)
    host = HostOverhead(dispatch_s=dispatch_s, roles=dict(roles), calibrated_on=label)
    fitted = _medians(simulate_with(host))
    return Calibration(host=host, measured_ttft_p50_ms=measured_ttft_p50_ms, measured_tpot_p50_ms=measured_tpot_p50_ms,
                       simulated_ttft_p50_ms=fitted[0], simulated_tpot_p50_ms=fitted[1],
                       engines_ttft_p50_ms=engines[0], engines_tpot_p50_ms=engines[1])


def _medians(summary: Summary) -> tuple[float, float]:
    ttft, tpot = summary.ttft_ms.p50, summary.tpot_ms.p50
    if ttft is None or tpot is None:
        raise ValueError("the replayed run completed no request with two or more tokens: nothing to calibrate on")
    return ttft, tpot
