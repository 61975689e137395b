"""Calibrate what serving adds (`HostOverhead`) on one measured run, so the simulator answers for the served stack.

Both figures are measured on one `kvbaton bench serve` run against a server started with `--step-trace`:

    each role's served steps  ◀─ the trace's steps over the profile's prediction for their shapes, and the
                                 pauses between them (kvbaton.sim.served_steps)
    the dispatch delay        ◀─ per prompt size, the median over its requests of the measured TTFT less the
                                 TTFT in the run's replay with those steps: what the engines do not explain

NOTE: the median, not the whole distribution. Drawn whole, the delays carried the replay's own spread too
(its steps are drawn already) and put short prompts' TTFT median 15% high on other loads; a level fitted
per size on top of them chased one run's noise. Nothing is fitted to a target: tails, TPOT and other loads
stay out of it, so validating on them tests the model, not the fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvbaton.sim.host import BUCKET_NAMES, BySize, HostOverhead, ServedSteps, prompt_bucket
from kvbaton.workload.metrics import SLO, summarize
from kvbaton.workload.records import RunResult


@dataclass(frozen=True, kw_only=True)
class Calibration:
    host: HostOverhead
    measured_ttft_p50_ms: float
    measured_tpot_p50_ms: float
    simulated_ttft_p50_ms: float  # with `host`
    simulated_tpot_p50_ms: float
    engines_ttft_p50_ms: float  # with no host overhead: what the figures had to explain
    engines_tpot_p50_ms: float


def calibrate(replay: Callable[[HostOverhead], RunResult], *, roles: Mapping[str, ServedSteps],
              measured_ttft_s: Mapping[int, float], measured_tpot_p50_ms: float, label: str = "") -> Calibration:
    """The host overhead of the measured run that `replay` simulates: `roles` as measured from its step trace, and
    per prompt size the median delay of its requests (`measured_ttft_s`, by request id) beyond their replay with
    those steps (at least 0)."""
    if not measured_ttft_s or measured_tpot_p50_ms <= 0:
        raise ValueError("calibration needs a measured run with completed requests and a positive TPOT median")
    stepped = replay(HostOverhead(roles=dict(roles)))
    beyond: list[list[float]] = [[] for _ in BUCKET_NAMES]
    for r in stepped.records:  # every replay's: a pooled run's request ids repeat
        if r.ok and r.ttft_s is not None and r.request_id in measured_ttft_s:
            beyond[prompt_bucket(r.prompt_len)].append(measured_ttft_s[r.request_id] - r.ttft_s)
    if not any(beyond):
        raise ValueError("the replayed run completed none of the measured requests: nothing to calibrate on")
    delays = tuple((max(0.0, _median(sorted(b))),) if b else () for b in beyond)
    host = HostOverhead(dispatch_s=BySize(delays), roles=dict(roles), calibrated_on=label)
    engines, fitted = (_medians(replay(h)) for h in (HostOverhead(), host))
    measured = sorted(measured_ttft_s.values())
    return Calibration(host=host, measured_ttft_p50_ms=_median(measured) * 1e3,
                       measured_tpot_p50_ms=measured_tpot_p50_ms, simulated_ttft_p50_ms=fitted[0],
                       simulated_tpot_p50_ms=fitted[1], engines_ttft_p50_ms=engines[0], engines_tpot_p50_ms=engines[1])


def _medians(result: RunResult) -> tuple[float, float]:
    summary = summarize(result, SLO())
    ttft, tpot = summary.ttft_ms.p50, summary.tpot_ms.p50
    if ttft is None or tpot is None:
        raise ValueError("the replayed run completed no request with two or more tokens: nothing to calibrate on")
    return ttft, tpot


def _median(values: list[float]) -> float:
    n = len(values)
    return (values[(n - 1) // 2] + values[n // 2]) / 2
