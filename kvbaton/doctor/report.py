"""The diagnosis as a terminal report (rich) and as JSON (`--json PATH`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbaton.doctor.findings import Finding, Severity, ranked

STEPS = (("interconnect", "1. Interconnect"), ("kv", "2. KV watermark"), ("compute", "3. Compute"),
         ("routing", "4. Routing"))
STYLE = {Severity.CRITICAL: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


@dataclass
class Report:
    url: str
    steps: dict[str, dict[str, Any]]  # step -> its figures
    findings: list[Finding]

    def as_json(self) -> dict[str, Any]:
        return {"url": self.url, "steps": self.steps, "findings": [f.as_json() for f in ranked(self.findings)]}

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_json(), indent=2, default=str) + "\n")


def render(report: Report, console: Console) -> None:
    console.rule(f"kvbaton doctor: {report.url}")
    for step, title in STEPS:
        console.print(f"\n[bold]{title}[/bold]")
        console.print(_figures(step, report.steps.get(step, {})))
        mine = ranked([f for f in report.findings if f.step == step])
        for f in mine:
            flag = f"  -> {escape(f.flag)}" if f.flag else ""
            console.print(f"  [{STYLE[f.severity]}]{f.severity.name.lower():<8}[/] {escape(f.message)}{flag}")
        if not mine:
            console.print("  [green]nothing to change[/green]")
    console.print()
    console.print(_ranked_table(report.findings))


def _ranked_table(findings: list[Finding]) -> Table:
    table = Table(title="Findings, most severe first", show_lines=False)
    for column in ("severity", "step", "finding", "flag to change"):
        table.add_column(column)
    for f in ranked(findings):
        table.add_row(f"[{STYLE[f.severity]}]{f.severity.name.lower()}[/]", f.step, escape(f.message),
                      escape(f.flag or ""))
    if not findings:
        table.add_row("[green]ok[/green]", "", "no findings", "")
    return table


def _figures(step: str, fig: dict[str, Any]) -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2))
    for name, value in _rows(step, fig):
        table.add_row(escape(name), escape(value))  # compute paths read "[bfloat16]": not markup
    return table


def _rows(step: str, fig: dict[str, Any]) -> list[tuple[str, str]]:
    if step == "interconnect":
        return _interconnect_rows(fig)
    if step == "kv":
        return [(k, _fmt(fig.get(k), k)) for k in ("kv_cache_usage", "max_worker_kv_usage", "kv_cache_waste",
                                                "num_running", "num_waiting", "num_preemptions", "preemptions_per_min",
                                                "preemptions_per_100_requests", "finished_requests", "rejected",
                                                "prefix_cache_hit_rate", "kv_store_hit_tokens")] + [
            (f"tier {name}", f"hit rate {tier.get('hit_rate', 0):.0%}, {tier.get('hits', 0):.0f} hits")
            for name, tier in fig.get("tiers", {}).items()]
    if step == "compute":
        return _compute_rows(fig)
    return [(k, _fmt(fig.get(k), k)) for k in ("local_prefill_threshold", "num_prefill", "num_decode", "requests",
                                            "share_at_least_threshold", "share_long", "share_long_local",
                                            "disaggregated_share")] + [("counters", _fmt(fig.get("counters")))]


def _interconnect_rows(fig: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("transport", str(fig.get("transport")))]
    for p in fig.get("pairs", []):
        small, large = p.get("small", {}), p.get("large", {})
        rows.append((f"{p['prefill']} -> {p['decode']}", p["error"] or (
            f"latency {small.get('median_ms', 0):.2f} ms ({small.get('num_bytes', 0) / 1e6:.2f} MB), "
            f"bandwidth {large.get('gbps', 0):.2f} GB/s ({large.get('num_bytes', 0) / 1e6:.1f} MB)")))
    if fig.get("skipped"):
        rows.append(("kv transfer", str(fig["skipped"])))
    ar = fig.get("all_reduce", {})
    for size in ar.get("sizes", []):
        rows.append((f"all-reduce {size['num_bytes'] / 1e6:.3g} MB x{ar.get('world_size')}",
                     f"{size['median_us']:.0f} us, bus bandwidth {size['busbw_gbps']:.2f} GB/s"))
    if ar.get("skipped"):
        rows.append(("all-reduce", str(ar["skipped"])))
    return rows


def _compute_rows(fig: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for w in fig.get("workers", []):
        rows.append((w["name"], str(w.get("compute_path"))))
        if w.get("num_steps"):
            ops = ", ".join(f"{op['name']} {op['share']:.0%}" for op in w.get("top_ops", [])[:5])
            rows.append(("", f"{w['num_steps']} steps of {w['step_ms']:.1f} ms: {w['compute_share']:.0%} in compute "
                             f"kernels, {w['outside_ops_share']:.0%} outside any op; top: {ops}"))
    if fig.get("profile"):
        rows.append(("profile", str(fig["profile"])))
    return rows


def _fmt(value: Any, name: str = "") -> str:
    if isinstance(value, float) and any(word in name for word in ("share", "usage", "rate", "waste")):
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items() if v)
    return "-" if value is None else str(value)
