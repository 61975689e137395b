"""Printed tables and the `--result-json` document."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvbaton.workload.metrics import SLO, LatencyStats, Summary
from kvbaton.workload.records import RunResult

_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(value: float | None) -> str:
    return "-" if value is None else (f"{value:.2f}" if value < 1000 else f"{value:.0f}")


def summary_table(s: Summary, slo: SLO) -> Table:
    table = Table(title=f"Serving benchmark: request rate {rate_label(s.request_rate)} req/s", show_header=False)
    rows = [
        ("Completed / sent / planned", f"{s.completed} / {s.num_sent} / {s.num_planned}"),
        ("Failed / rejected (429, 503) / cancelled", f"{s.failed} / {s.rejected} / {s.cancelled}"),
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Total input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
    ]
    if s.goodput is not None:
        rows.append((f"Goodput (req/s) [{slo_label(slo)}]", f"{s.goodput:.2f}"))
        rows.append(("SLO attainment", f"{s.slo_attainment:.1%}"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def latency_table(s: Summary) -> Table:
    table = Table(title="Latency (ms)")
    for column in ("metric", "count", "mean", "p50", "p90", "p99"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, attr in _LATENCIES:
        st: LatencyStats = getattr(s, attr)
        table.add_row(name, str(st.count), _ms(st.mean), _ms(st.p50), _ms(st.p90), _ms(st.p99))
    return table


def sweep_table(summaries: list[Summary]) -> Table:
    table = Table(title="Rate sweep")
    columns = ("rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput", "SLO att.")
    for column in columns:
        table.add_column(column, justify="right")
    for s in summaries:
        goodput = "-" if s.goodput is None else f"{s.goodput:.2f}"
        attainment = "-" if s.slo_attainment is None else f"{s.slo_attainment:.1%}"
        table.add_row(rate_label(s.request_rate), f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}",
                      _ms(s.ttft_ms.p50), _ms(s.ttft_ms.p99), _ms(s.tpot_ms.p50), _ms(s.tpot_ms.p99),
                      goodput, attainment)
    return table


def slo_label(slo: SLO) -> str:
    parts = [f"TTFT <= {slo.ttft_ms:g} ms"] if slo.ttft_ms is not None else []
    parts += [f"TPOT <= {slo.tpot_ms:g} ms"] if slo.tpot_ms is not None else []
    return ", ".join(parts)


def print_report(summaries: list[Summary], slo: SLO, console: Console) -> None:
    for s in summaries:
        console.print(summary_table(s, slo))
        console.print(latency_table(s))
    if len(summaries) > 1:
        console.print(sweep_table(summaries))


def result_document(config: dict, results: list[RunResult], summaries: list[Summary]) -> dict:
    """Everything needed to re-plot or re-score a run: config (with seed), per-request records, summaries."""
    runs = [{"request_rate": r.request_rate, "summary": asdict(s), "records": [rec.to_dict() for rec in r.records]}
            for r, s in zip(results, summaries)]
    return _jsonable_dict({"config": config, "runs": runs})


def write_result_json(path: str | Path, document: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def _jsonable(obj: object) -> object:
    """Strict JSON: infinite rates become the string "inf" (JSON has no Infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return _jsonable_dict(obj)
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _jsonable_dict(d: dict) -> dict:
    return {k: _jsonable(v) for k, v in d.items()}
