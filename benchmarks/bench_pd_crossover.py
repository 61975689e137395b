"""When does disaggregation pay on this CPU? A measured grid of long-prompt length x share, and the simulator's.

    .venv/bin/python benchmarks/bench_pd_crossover.py                        # 3 x 3 grid (~30 min, 2 cores)
    .venv/bin/python benchmarks/bench_pd_crossover.py --lengths 512,2048 --shares 0.15 --num-prompts 16

Two set-ups of `kvbaton serve` (default model, bf16), each given this machine's 2 cores, as bench_pd.py:

    pd      --prefill 1 --decode 1 --threads 1 --local-prefill-threshold 256   (long prompts on the prefill worker)
    single  --threads 2 --max-num-batched-tokens 256                           (one chunked-prefill worker)

Each cell of the grid is one `kvbaton bench serve --dataset mixed` run (short prompts 64 tokens, 64 output
tokens, --ignore-eos, the cell's share of long prompts at the cell's length, at --rate req/s), the same seed
for both set-ups. Its recorded trace is then replayed through `kvbaton sim` with this machine's step
profiles, once with the engines alone (the simulator's default) and once with each set-up's calibration
(`kvbaton sim calibrate` on a load of its own, none of the grid's: served steps per role, dispatch delay).
Reported per cell: TPOT p99 of pd / single (below 1: disaggregation wins), measured and simulated, and per
share the crossover length (the shortest long prompt from which pd wins).

Writes benchmarks/results/pd-crossover-<date>.json, pd-crossover-<cpu kind>.md and .png.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from common.machine import cpu_kind, cpu_name, kvbaton_commit
from common.prompts import fresh_seed
from common.report import RESULTS_DIR, command_line, read_json, stamp, write_json
from common.servers import Server, free_port, kvbaton_server
from common.sim import (
    CALIBRATION_TEXT,
    COMMON_SERVE_ARGS,
    KV_GB,
    Deployment,
    HostOverhead,
    ensure_host_overhead,
    ensure_profile,
    kv_pool,
    replay,
    require_traces,
)
from kvbaton.workload.metrics import SLO

SETUPS = {"pd": Deployment(threads=1, num_prefill=1, local_prefill_threshold=256),
          "single": Deployment(threads=2, max_num_batched_tokens=256)}
TPOT_SLO_MS = 150.0


def cell_args(length: int, share: float, rate: float, n: int, seed: int, model_dir: str) -> list[str]:
    return ["--dataset", "mixed", "--long-fraction", str(share), "--long-input-len", str(length),
            "--short-input-len", "64", "--output-len", "64", "--ignore-eos", "--request-rate", str(rate),
            "--num-prompts", str(n), "--seed", str(seed), "--tokenizer", model_dir, "--num-warmups", "2",
            "--no-progress"]


def measure_setup(name: str, cells: list[tuple[int, float]], args: argparse.Namespace, seed: int, run_stamp: str,
                  model_dir: str) -> dict[str, Path]:
    """One server for the set-up, one bench run per cell; the trace file of each cell."""
    spec = kvbaton_server(name=f"kvbaton serve ({name})", port=free_port(),
                          serve_args=[*COMMON_SERVE_ARGS, *SETUPS[name].serve_args()], env=dict(os.environ),
                          timeout_s=300, log_path=RESULTS_DIR / f"pd-crossover-{run_stamp}-{name}.log",
                          health_path="/health")
    traces = {}
    with Server(spec) as server:
        for i, (length, share) in enumerate(cells):
            out = RESULTS_DIR / f"pd-crossover-{run_stamp}-{name}-{length}-{share}.json"
            print(f"   {name}: long {length} x {share:.0%}", flush=True)
            subprocess.run([sys.executable, "-m", "kvbaton.cli", "bench", "serve", "--base-url", server.base_url,
                            *cell_args(length, share, args.rate, args.num_prompts, seed + i, model_dir),
                            "--result-json", str(out)], check=True, stdout=subprocess.DEVNULL)
            traces[f"{length}x{share}"] = out
    return traces


def crossover(ratios: dict[int, float | None]) -> int | None:
    """The shortest long-prompt length from which pd stays better (ratio < 1); None if it never is."""
    lengths = sorted(ratios)
    for i, length in enumerate(lengths):
        if all((ratios[x] or 2.0) < 1.0 for x in lengths[i:]):
            return length
    return None


# Where each ratio comes from: the measurement, the simulator as `kvbaton sim run` is by default (the engines
# alone, step profiles only), and the simulator with the set-up's calibration (`kvbaton sim calibrate`).
SOURCES = {"measured": "", "simulated": "sim_", "calibrated": "simhost_"}
TITLES = {"measured": "measured", "simulated": "simulated (engines)", "calibrated": "simulated, calibrated"}


def score(doc: dict, lengths: list[int], shares: list[float]) -> None:
    steps = [*lengths, None]
    for share in shares:
        cross = doc["crossover"].setdefault(str(share), {})
        for source in SOURCES:
            row = {length: doc["cells"][f"{length}x{share}"].get(f"{source}_ratio") for length in lengths}
            cross[source] = crossover(row)
        for source in ("simulated", "calibrated"):
            cross[f"{source}_grid_steps_apart"] = abs(steps.index(cross["measured"]) - steps.index(cross[source]))


def write_report(doc: dict, lengths: list[int], shares: list[float], path: Path) -> None:
    lines = ["# When to disaggregate on this CPU: the crossover, measured and simulated", "",
             f"Command: `{doc['command']}`", "",
             f"Measured {doc['started']} (simulated {doc.get('simulated', doc['started'])}) on {doc['cpu']}, commit "
             f"{doc['commit']}, seed {doc['seed']}, "
             f"{doc['num_prompts']} requests per cell at {doc['rate']} req/s; wall {doc['wall_s']:.0f} s.", "",
             "TPOT p99 of 1P+1D (1 thread each) over one chunked-prefill worker (2 threads): measured | simulated "
             "with the engines alone (`kvbaton sim run`'s default: the step profiles) | simulated with each set-up's "
             "calibration, measured on a load of its own (" + CALIBRATION_TEXT + "). The simulator "
             "replays each measured cell's trace (5 seeds pooled). Below 1: disaggregation wins. Crossover: the "
             "shortest long-prompt length from which 1P+1D stays better.", "",
             *[f"- {name}: {h}" for name, h in doc["host"].items()], "",
             "| long share \\ length | " + " | ".join(str(n) for n in lengths)
             + " | crossover measured | simulated (engines) | simulated, calibrated |",
             "|---|" + "---|" * (len(lengths) + 3)]
    for share in shares:
        cells = [doc["cells"][f"{n}x{share}"] for n in lengths]
        cross = doc["crossover"][str(share)]
        triples = [" \\| ".join(_f(c.get(f"{source}_ratio")) for source in SOURCES) for c in cells]
        lines.append(f"| {share:.0%} | " + " | ".join(triples) + " | "
                     + " | ".join(_cross(cross[source], lengths) for source in SOURCES) + " |")
    lines += ["", "Per cell, TPOT p99 ms (pd / single): measured, simulated (engines), simulated (calibrated):", ""]
    for key, c in doc["cells"].items():
        lines.append(f"- {key}: " + ", ".join(f"{_f(c.get(f'{prefix}pd_tpot_p99'))} / "
                                              f"{_f(c.get(f'{prefix}single_tpot_p99'))}"
                                              for prefix in SOURCES.values()))
    path.write_text("\n".join(lines) + "\n")


def _cross(length: int | None, lengths: list[int]) -> str:
    """The crossover as the grid can tell it: at its shortest length, only that it is no longer."""
    return "never" if length is None else f"<= {length}" if length == lengths[0] else str(length)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(doc: dict, lengths: list[int], shares: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(SOURCES), figsize=(5 * len(SOURCES), 4), sharey=True)
    for ax, source in zip(axes, SOURCES):
        grid = np.array([[doc["cells"][f"{n}x{s}"].get(f"{source}_ratio") or np.nan for n in lengths]
                         for s in shares])
        im = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.5, vmax=1.5, origin="lower")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(shares)), [f"{s:.0%}" for s in shares])
        ax.set_xlabel("long prompt tokens")
        ax.set_title(f"{TITLES[source]}: TPOT p99 pd / single", fontsize=9)
    axes[0].set_ylabel("share of long prompts")
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--shares", default="0.05,0.15,0.3")
    ap.add_argument("--rate", type=float, default=0.4)
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--profiles-from", type=Path, default=RESULTS_DIR,
                    help="this CPU kind's sim-profile-*.json, sim-host-*.json (else measured or calibrated)")
    ap.add_argument("--replay", type=Path, nargs="+", default=None, metavar="RUN_JSON",
                    help="simulate previous runs' measured cells (pd-crossover-<date>.json, its cells' traces beside "
                         "it; several: one grid, e.g. an extension to shorter prompts) again, e.g. with a refitted "
                         "step model; measures nothing")
    return ap.parse_args()


def replay_sources(paths: list[Path], runs: list[dict], args: argparse.Namespace) -> dict[str, Path]:
    """Each replayed cell's run JSON; the grid, rate and seed of the measured runs go into `args`."""
    sources = {key: path for path, run in zip(paths, runs) for key in run["cells"]}
    args.lengths, args.shares = (",".join(sorted({k.split("x")[i] for k in sources}, key=float)) for i in (0, 1))
    args.rate, args.num_prompts, args.seed = runs[0]["rate"], runs[0]["num_prompts"], runs[0]["seed"]
    if {(r["rate"], r["num_prompts"]) for r in runs} != {(args.rate, args.num_prompts)}:
        raise SystemExit("--replay: the runs differ in rate or requests per cell; they are not one grid")
    return sources


def replayed_traces(name: str, cells: list[tuple[int, float]], sources: dict[str, Path]) -> dict[str, Path]:
    """Set-up `name`'s measured trace of each cell, beside its run's JSON:
    pd-crossover-<stamp>-<set-up>-<length>-<share>.json."""
    return {f"{n}x{s}": sources[f"{n}x{s}"].with_name(f"{sources[f'{n}x{s}'].stem}-{name}-{n}-{s}.json")
            for n, s in cells}


def simulate_cells(doc: dict, name: str, traces: dict[str, Path], profile: Path, host: HostOverhead,
                   pool: tuple[int, int], slo: SLO) -> None:
    """Set-up `name`'s measured TPOT p99 per cell, and its replays: the engines alone and calibrated."""
    deployment = SETUPS[name]
    for key, trace in traces.items():
        measured = read_json(trace)["runs"][0]["summary"]
        engines, _ = replay(deployment, trace, profile, pool, slo)
        calibrated, _ = replay(deployment, trace, profile, pool, slo, host)
        doc["cells"][key].update({f"{name}_tpot_p99": measured["tpot_ms"]["p99"],
                                  f"sim_{name}_tpot_p99": engines.tpot_ms.p99,
                                  f"simhost_{name}_tpot_p99": calibrated.tpot_ms.p99})


def add_ratios(doc: dict) -> None:
    """Each cell's pd / single TPOT p99, per source (measured, simulated, calibrated)."""
    for c in doc["cells"].values():
        for source, prefix in SOURCES.items():
            pd, single = c.get(f"{prefix}pd_tpot_p99"), c.get(f"{prefix}single_tpot_p99")
            c[f"{source}_ratio"] = pd / single if pd and single else None


def main() -> None:
    args = parse_args()
    runs = [read_json(path) for path in args.replay or ()]
    sources = replay_sources(args.replay, runs, args) if runs else {}
    lengths, shares = [int(x) for x in args.lengths.split(",")], [float(x) for x in args.shares.split(",")]
    cells = [(n, s) for s in shares for n in lengths]
    replayed = {name: replayed_traces(name, cells, sources) for name in SETUPS} if runs else {}
    require_traces([trace for traces in replayed.values() for trace in traces.values()])
    from kvbaton.models.registry import pull_default_model

    model_dir = str(pull_default_model())
    seed = fresh_seed() if args.seed is None else args.seed
    started = datetime.now()
    run_stamp = stamp(started)
    profiles = {t: ensure_profile(t, RESULTS_DIR, model_dir, args.profiles_from) for t in (1, 2)}
    hosts = {name: ensure_host_overhead(d, RESULTS_DIR, model_dir, args.profiles_from, profile=profiles[d.threads],
                                        seed=seed - 1 - i) for i, (name, d) in enumerate(SETUPS.items())}
    doc: dict = {"started": ", ".join(r["started"] for r in runs) or started.isoformat(timespec="seconds"),
                 "simulated": started.isoformat(timespec="seconds"),
                 "command": command_line("bench_pd_crossover.py", sys.argv[1:]), "commit": kvbaton_commit(),
                 "cpu": f"{cpu_name()} ({cpu_kind()})", "seed": ", ".join(str(r["seed"]) for r in runs) or seed,
                 "host": {name: h.describe() for name, h in hosts.items()}, "rate": args.rate,
                 "num_prompts": args.num_prompts,
                 "cells": {f"{n}x{s}": {} for n, s in cells}, "crossover": {}}
    t0 = time.monotonic()
    pool, slo = kv_pool(model_dir, KV_GB), SLO(tpot_ms=TPOT_SLO_MS)
    for name, deployment in SETUPS.items():
        print(f"== {name}: kvbaton serve {' '.join(deployment.serve_args())}", flush=True)
        traces = replayed[name] if runs else measure_setup(name, cells, args, seed, run_stamp, model_dir)
        simulate_cells(doc, name, traces, profiles[deployment.threads], hosts[name], pool, slo)
    add_ratios(doc)
    score(doc, lengths, shares)
    doc["wall_s"] = time.monotonic() - t0
    write_json(RESULTS_DIR / f"pd-crossover-{run_stamp}.json", doc, indent=1)
    report = RESULTS_DIR / f"pd-crossover-{cpu_kind()}.md"
    write_report(doc, lengths, shares, report)
    plot(doc, lengths, shares, report.with_suffix(".png"))
    print(report.read_text())


if __name__ == "__main__":
    main()
