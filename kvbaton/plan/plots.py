"""PNG plots for `--plot-dir`: goodput per GPU by configuration, and each configuration's memory per GPU.

NOTE: built with `matplotlib.figure.Figure` and its Agg canvas, never pyplot (no GUI backend, no global
figure state); matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvbaton.plan.candidate import Candidate

GB = 1e9


def write_plots(plot_dir: str | Path, candidates: Sequence[Candidate], title: str,
                highlight: str | None = None) -> list[Path]:
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    fitting = [c for c in candidates if c.fits]
    return [plot_goodput(out / "goodput_per_gpu.png", fitting, title, highlight),
            plot_memory(out / "memory_per_gpu.png", _distinct_memory(candidates), title)]


def _distinct_memory(candidates: Sequence[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in candidates:
        key = (c.deployment.parallel, c.deployment.kv_dtype)  # a scheduler variant moves only the reserve
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _label(c: Candidate) -> str:
    d = c.deployment
    return d.label + ("" if d.kv_dtype.element_bytes == 2 else f" kv {d.kv_dtype.value}")


def plot_goodput(path: Path, candidates: Sequence[Candidate], title: str, highlight: str | None) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 0.45 * len(candidates) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    labels = [_label(c) for c in candidates]
    colors = ["tab:orange" if c.deployment.disaggregated else "tab:blue" for c in candidates]
    colors = ["tab:red" if label == highlight else color for label, color in zip(labels, colors)]
    ax.barh(labels, [c.per_device for c in candidates], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("goodput per GPU (req/s meeting the SLOs at the attainment target)")
    ax.set_title(f"{title}\nblue: colocated, orange: prefill/decode split" + (", red: current" if highlight else ""))
    fig.savefig(path, dpi=110)
    return path


def plot_memory(path: Path, candidates: Sequence[Candidate], title: str) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 0.45 * len(candidates) + 2.2), layout="constrained")
    ax = fig.add_subplot()
    labels = [_label(c) for c in candidates]
    parts = {"weights": [c.memory.weight_bytes / GB for c in candidates],
             "runtime + activations": [c.memory.reserve_bytes / GB for c in candidates],
             "KV pool": [max(c.memory.kv_pool_bytes, 0.0) / GB for c in candidates],
             "left to the device": [(c.memory.device_bytes - c.memory.usable_bytes) / GB for c in candidates]}
    left = [0.0] * len(candidates)
    for (name, values), color in zip(parts.items(), ("tab:gray", "tab:purple", "tab:green", "whitesmoke")):
        ax.barh(labels, values, left=left, label=name, color=color, edgecolor="black", linewidth=0.3)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("GB per GPU")
    ax.set_title(f"{title}\nmemory of one GPU")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=4, fontsize="small")
    fig.savefig(path, dpi=110)
    return path
