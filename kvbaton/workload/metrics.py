"""The numbers a run is judged by: throughput, latency percentiles, goodput and SLO attainment.

Definitions (all over the requests that completed, unless said otherwise):
  TTFT   send -> first content chunk
  TPOT   (E2E - TTFT) / (output_tokens - 1), per request
  ITL    every gap between two consecutive content chunks, pooled over requests
  E2E    send -> end of stream
  goodput         requests/s that met both the TTFT and the TPOT SLO (DistServe's definition)
  SLO attainment  that count / every request that finished (ok, error or rejected): a failed
                  or rejected request did not meet its SLO. Requests cut off by
                  --max-duration-s are left out.
Percentiles interpolate linearly between order statistics (numpy's default, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbaton.workload.errors import WorkloadError
from kvbaton.workload.records import RequestRecord, RunResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets in milliseconds; None means no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if any(v is not None and v <= 0 for v in (self.ttft_ms, self.tpot_ms)):
            raise WorkloadError("--slo-ttft-ms and --slo-tpot-ms must be positive")

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.ok or rec.ttft_s is None:
            return False
        # NOTE: a one-token answer has no TPOT, so it cannot miss the TPOT target.
        tpot_ms = (rec.tpot_s or 0.0) * 1000
        ttft_ok = self.ttft_ms is None or rec.ttft_s * 1000 <= self.ttft_ms
        return ttft_ok and (self.tpot_ms is None or tpot_ms <= self.tpot_ms)


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency metric, in ms; all None when nothing was measured."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> LatencyStats:
        if len(values_ms) == 0:
            return cls(0, None, None, None, None)
        p50, p90, p99 = (percentile(values_ms, p) for p in PERCENTILES)
        return cls(len(values_ms), float(np.mean(values_ms)), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    """One load level, summarized."""

    request_rate: float
    max_concurrency: int | None
    duration_s: float
    num_planned: int
    num_sent: int
    completed: int
    failed: int
    rejected: int
    cancelled: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests / s meeting the SLO; None without an SLO
    slo_attainment: float | None
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile, linear interpolation: index p/100 * (n - 1) into the sorted values."""
    return float(np.percentile(np.asarray(values, dtype=float), p))


def count_status(records: Sequence[RequestRecord], status: str) -> int:
    return sum(r.status == status for r in records)


def good_count(records: Sequence[RequestRecord], slo: SLO) -> int:
    return sum(slo.met_by(r) for r in records)


def summarize(result: RunResult, slo: SLO) -> Summary:
    recs = result.records
    ok = [r for r in recs if r.ok]
    finished = len(recs) - count_status(recs, "cancelled")
    in_tokens, out_tokens = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    per_s = 1.0 / result.duration_s if result.duration_s > 0 else 0.0
    good = good_count(recs, slo)
    return Summary(
        request_rate=result.request_rate, max_concurrency=result.max_concurrency, duration_s=result.duration_s,
        num_planned=result.num_planned, num_sent=len(recs), completed=len(ok),
        failed=count_status(recs, "error"), rejected=count_status(recs, "rejected"),
        cancelled=count_status(recs, "cancelled"), total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) * per_s, output_throughput=out_tokens * per_s,
        total_token_throughput=(in_tokens + out_tokens) * per_s,
        goodput=good * per_s if slo.active else None,
        slo_attainment=(good / finished if finished else 0.0) if slo.active else None,
        **latency_stats(ok),
    )


def latency_stats(ok: Sequence[RequestRecord]) -> dict[str, LatencyStats]:
    """TTFT / TPOT / ITL / E2E statistics over completed requests, in ms."""
    return {
        "ttft_ms": LatencyStats.of([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        "tpot_ms": LatencyStats.of([r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        "itl_ms": LatencyStats.of([gap * 1000 for r in ok for gap in r.itl_s]),
        "e2e_ms": LatencyStats.of([r.e2e_s * 1000 for r in ok if r.e2e_s is not None]),
    }
