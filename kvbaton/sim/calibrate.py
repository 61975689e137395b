"""Fit the frontend's costs (`HostOverhead`) to one measured run, so the simulator answers for the served stack.

The fit uses medians only (TTFT p50 and TPOT p50 of a `kvbaton bench serve` run replayed through the
simulator); tails and other loads stay out of it, so validating on them tests the model, not the fit.

    TPOT p50 rises with the per-token price  ─▶ bisect the price until simulated TPOT p50 = measured
    TTFT p50 rises one for one with dispatch ─▶ dispatch = measured - simulated TTFT p50 (at least 0)

Two rounds: the dispatch delay shifts arrivals a little, which moves batching and so TPOT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvbaton.bench.metrics import Summary
from kvbaton.sim.host import HostOverhead

MAX_PER_TOKEN_S = 0.05  # far above any frontend's cost per token; the bisection's upper end
_BISECTIONS = 20  # 50 ms / 2**20: well under a microsecond


@dataclass(frozen=True, kw_only=True)
class Calibration:
    host: HostOverhead
    measured_ttft_p50_ms: float
    measured_tpot_p50_ms: float
    simulated_ttft_p50_ms: float  # with `host`
    simulated_tpot_p50_ms: float
    uncalibrated_ttft_p50_ms: float  # with no host overhead: what the fit had to explain
    uncalibrated_tpot_p50_ms: float


def calibrate(simulate_with: Callable[[HostOverhead], Summary], *, measured_ttft_p50_ms: float,
              measured_tpot_p50_ms: float, label: str = "", host_cores: int = 0) -> Calibration:
    """The host overhead under which `simulate_with` (the measured run's replay) matches its medians;
    `host_cores` as `HostOverhead.host_cores` (the price is fitted to the steps that pay it)."""
    if not (measured_ttft_p50_ms > 0 and measured_tpot_p50_ms > 0):
        raise ValueError("calibration needs a measured run with a positive TTFT and TPOT median")

    def medians(host: HostOverhead) -> tuple[float, float]:
        summary = simulate_with(host)
        ttft, tpot = summary.ttft_ms.p50, summary.tpot_ms.p50
        if ttft is None or tpot is None:
            raise ValueError("the replayed run completed no request with two or more tokens: nothing to fit")
        return ttft, tpot

    def tpot_at(dispatch_s: float, per_token_s: float) -> float:
        return medians(HostOverhead(dispatch_s=dispatch_s, per_token_s=per_token_s, host_cores=host_cores))[1]

    base = medians(HostOverhead())
    dispatch_s = per_token_s = 0.0
    for _ in range(2):
        per_token_s = _bisect_per_token(partial(tpot_at, dispatch_s), measured_tpot_p50_ms)
        ttft = medians(HostOverhead(per_token_s=per_token_s, host_cores=host_cores))[0]
        dispatch_s = max(0.0, (measured_ttft_p50_ms - ttft) / 1e3)
    host = HostOverhead(dispatch_s=dispatch_s, per_token_s=per_token_s, host_cores=host_cores, calibrated_on=label)
    fitted = medians(host)
    return Calibration(host=host, measured_ttft_p50_ms=measured_ttft_p50_ms,
                       measured_tpot_p50_ms=measured_tpot_p50_ms, simulated_ttft_p50_ms=fitted[0],
                       simulated_tpot_p50_ms=fitted[1], uncalibrated_ttft_p50_ms=base[0],
                       uncalibrated_tpot_p50_ms=base[1])


def _bisect_per_token(tpot: Callable[[float], float], target_ms: float) -> float:
    """The smallest per-token price (to the bisection's resolution) whose TPOT p50 reaches `target_ms`; 0 when
    the engines alone already reach it, MAX_PER_TOKEN_S when nothing below it does."""
    if tpot(0.0) >= target_ms:
        return 0.0
    lo, hi = 0.0, MAX_PER_TOKEN_S
    if tpot(hi) < target_ms:
        return hi
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tpot(mid) < target_ms else (lo, mid)
    return hi
