"""PNG plots for `--plot-dir`: latency CDFs per run, and goodput / SLO attainment across a rate sweep.

NOTE: figures are built with `matplotlib.figure.Figure` and the Agg canvas directly, never
through pyplot, so no GUI backend or global figure state is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvbaton.workload.metrics import SLO, Summary
from kvbaton.workload.records import RunResult
from kvbaton.workload.report import rate_label, slo_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def write_plots(plot_dir: str | Path, results: list[RunResult], summaries: list[Summary], slo: SLO) -> list[Path]:
    """Write every plot that applies; returns their paths."""
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdfs(out / "latency_cdf.png", results, slo)]
    swept = [s for s in summaries if math.isfinite(s.request_rate)]
    if len(swept) > 1:
        paths.append(plot_goodput(out / "goodput_vs_rate.png", swept))
        if slo.active:
            paths.append(plot_attainment(out / "slo_attainment_vs_rate.png", swept, slo))
    return paths


def _figure(ncols: int = 1) -> tuple[Figure, Sequence[Axes]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * ncols, 4.0), layout="constrained")
    return fig, fig.subplots(1, ncols, squeeze=False)[0]  # a 1-D object array of Axes, used as a sequence


def _latencies_ms(result: RunResult) -> dict[str, list[float]]:
    ok = [r for r in result.records if r.ok]
    return {
        "TTFT": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s * 1000 for r in ok if r.tpot_s is not None],
        "E2E": [r.e2e_s * 1000 for r in ok if r.e2e_s is not None],
    }


def plot_latency_cdfs(path: Path, results: list[RunResult], slo: SLO) -> Path:
    fig, axes = _figure(3)
    targets = {"TTFT": slo.ttft_ms, "TPOT": slo.tpot_ms, "E2E": None}
    for result in results:
        for ax, values in zip(axes, _latencies_ms(result).values()):
            if values:
                xs = np.sort(values)
                fractions = np.arange(len(xs) + 1) / len(xs)  # starts at 0 just left of the fastest
                ax.step(np.concatenate([xs[:1], xs]), fractions, where="post",
                        label=f"{rate_label(result.request_rate)} req/s")
    for ax, (name, target) in zip(axes, targets.items()):
        if target is not None:
            ax.axvline(target, color="red", linestyle="--", label="SLO")
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_goodput(path: Path, summaries: list[Summary]) -> Path:
    fig, (ax,) = _figure()
    rates = [s.request_rate for s in summaries]
    ax.plot(rates, [s.request_throughput for s in summaries], marker="o", label="throughput (completed req/s)")
    if summaries[0].goodput is not None:
        ax.plot(rates, _slo_series([s.goodput for s in summaries]), marker="s", label="goodput (req/s meeting SLO)")
    ax.plot(rates, rates, color="gray", linestyle=":", label="offered load")
    ax.set(title="Goodput vs request rate", xlabel="request rate (req/s)", ylabel="req/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_attainment(path: Path, summaries: list[Summary], slo: SLO) -> Path:
    fig, (ax,) = _figure()
    ax.plot([s.request_rate for s in summaries], _slo_series([s.slo_attainment for s in summaries]), marker="o")
    ax.set(title=f"SLO attainment ({slo_label(slo)})", xlabel="request rate (req/s)",
           ylabel="fraction of requests meeting SLO", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return path


def _slo_series(values: list[float | None]) -> list[float]:
    """Goodput or attainment per run: set for every run when an SLO is; a None would plot as a gap."""
    return [math.nan if v is None else v for v in values]
