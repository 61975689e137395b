from __future__ import annotations

import pytest

from kvbaton.workload.errors import WorkloadError
from kvbaton.workload.metrics import SLO, LatencyStats, percentile, summarize
from kvbaton.workload.records import RequestRecord, RunResult


def _ok(rid: int, ttft: float, gap: float, tokens: int, prompt_len: int = 10) -> RequestRecord:
    itl = (gap,) * (tokens - 1)
    return RequestRecord(rid, prompt_len, tokens, scheduled_s=0.0, send_s=0.0, status="ok", ttft_s=ttft,
                         e2e_s=ttft + sum(itl), itl_s=itl, output_tokens=tokens, http_status=200)


def _records() -> tuple[RequestRecord, ...]:
    return (
        _ok(0, ttft=0.050, gap=0.010, tokens=10),  # meets both
        _ok(1, ttft=0.200, gap=0.010, tokens=10),  # TTFT 200 ms > 100 ms
        _ok(2, ttft=0.050, gap=0.030, tokens=10),  # TPOT 30 ms > 20 ms
        _ok(3, ttft=0.080, gap=0.0, tokens=1),  # one token: no TPOT, meets the SLO
        RequestRecord(4, 10, 10, 0.0, 0.0, status="rejected", http_status=429),
        RequestRecord(5, 10, 10, 0.0, 0.0, status="cancelled"),
    )


def test_percentile_interpolates_linearly():
    # sorted [10, 20, 30, 40]: index p/100 * 3
    assert percentile([40, 10, 30, 20], 50) == pytest.approx(25.0)
    assert percentile([40, 10, 30, 20], 90) == pytest.approx(37.0)
    assert percentile([40, 10, 30, 20], 99) == pytest.approx(39.7)
    assert percentile([5], 99) == 5


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert _ok(0, 0.05, 0.01, 10).tpot_s == pytest.approx(0.01)
    assert _ok(0, 0.05, 0.0, 1).tpot_s is None
    assert RequestRecord(0, 1, 1, 0, 0, status="error", ttft_s=0.1, e2e_s=0.5, output_tokens=5).tpot_s is None


def test_goodput_and_attainment_against_a_hand_computed_example():
    s = summarize(RunResult(2.0, None, 2.0, 8, _records()), SLO(ttft_ms=100, tpot_ms=20))
    assert (s.num_planned, s.num_sent, s.completed, s.failed, s.rejected, s.cancelled) == (8, 6, 4, 0, 1, 1)
    assert s.goodput == pytest.approx(2 / 2.0)  # requests 0 and 3, over 2 s
    assert s.slo_attainment == pytest.approx(2 / 5)  # the cancelled one is not counted, the rejected one is
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.total_output_tokens == 31 and s.output_throughput == pytest.approx(15.5)
    assert s.total_token_throughput == pytest.approx((40 + 31) / 2.0)
    assert s.tpot_ms.count == 3 and s.tpot_ms.mean == pytest.approx(50 / 3) and s.tpot_ms.p50 == pytest.approx(10)
    assert s.ttft_ms.mean == pytest.approx((50 + 200 + 50 + 80) / 4)
    assert s.itl_ms.count == 27 and s.itl_ms.p99 == pytest.approx(30)


def test_a_single_slo_constrains_only_its_metric():
    s = summarize(RunResult(2.0, None, 2.0, 6, _records()), SLO(tpot_ms=20))
    assert s.goodput == pytest.approx(3 / 2.0)  # 0, 1 and 3; request 2 misses TPOT


def test_no_slo_means_no_goodput_and_empty_stats_are_none():
    s = summarize(RunResult(1.0, 4, 1.0, 1, (RequestRecord(0, 1, 1, 0, 0, status="error", error="x"),)), SLO())
    assert s.goodput is None and s.slo_attainment is None and s.completed == 0
    assert s.ttft_ms == LatencyStats(0, None, None, None, None)
    with pytest.raises(WorkloadError):
        SLO(ttft_ms=0)


def test_record_round_trips_through_a_dict():
    rec = _records()[0]
    d = rec.to_dict()
    assert d["tpot_s"] == pytest.approx(0.01) and isinstance(d["itl_s"], list)
    assert RequestRecord.from_dict(d) == rec
