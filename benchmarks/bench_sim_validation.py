"""Is the simulator right? Measured vs simulated TTFT and TPOT (p50, p99) on this machine, load by load.

    .venv/bin/python benchmarks/bench_sim_validation.py        # profiles, calibrations, 6 loads (~35 min, 2 cores)
    .venv/bin/python benchmarks/bench_sim_validation.py --profiles-from benchmarks/results  # reuse profiles
    .venv/bin/python benchmarks/bench_sim_validation.py --loads pd-mixed --num-prompts 20

First, per worker thread count, the step-latency model (`kvbaton sim profile`, the engine alone); per
deployment, what serving adds (`kvbaton sim calibrate`, kvbaton.sim.host): served steps over profiled ones,
per role, measured from the step trace of one calibration load that is none of the loads below, and the
median dispatch delay per prompt size beyond that load's replay. Then for each load: start `kvbaton serve`
(default model, bf16, nothing else on the machine), drive it with `kvbaton bench serve` (fresh seed,
--ignore-eos, --result-json), stop it; replay the recorded run (the same send times and lengths) through the simulator
(5 seeds pooled), calibrated and without calibration (the engines alone). Targets (Vidur reports < 9%):
within 10% at p50 and 15% at p99. The peer here is reality itself: every ratio is simulated / measured.

Writes benchmarks/results/sim-validation-<date>.json and sim-validation-<cpu kind>.md (profiles and
calibrations are kept per CPU kind too: sim-profile-<kind>-t{1,2}.json, sim-host-<kind>-<deployment>.json;
the calibration run and its step traces are written beside it, to refit on, and are not committed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from common.machine import cpu_kind, cpu_name, kvbaton_commit
from common.prompts import fresh_seed
from common.report import RESULTS_DIR, command_line, read_json, stamp, write_json
from common.sim import (
    CALIBRATION_TEXT,
    KV_GB,
    RANDOM,
    Deployment,
    HostOverhead,
    ensure_host_overhead,
    ensure_profile,
    kv_pool,
    measure,
    replay,
    require_traces,
)
from kvbaton.workload.metrics import SLO, Summary

TARGETS = {"p50": 0.10, "p99": 0.15}


@dataclass(frozen=True, kw_only=True)
class Load:
    name: str
    bench_args: list[str]  # the dataset and rate, as `kvbaton bench serve` flags
    deployment: Deployment


MIXED = ["--dataset", "mixed", "--long-fraction", "0.15", "--long-input-len", "1024", "--short-input-len", "64",
         "--output-len", "64", "--request-rate", "0.4"]
LOADS = [
    Load(name="colocated-0.5", bench_args=[*RANDOM, "--request-rate", "0.5"], deployment=Deployment(threads=2)),
    Load(name="colocated-1.5", bench_args=[*RANDOM, "--request-rate", "1.5"], deployment=Deployment(threads=2)),
    Load(name="colocated-3", bench_args=[*RANDOM, "--request-rate", "3"], deployment=Deployment(threads=2)),
    Load(name="pd-mixed", bench_args=MIXED,
         deployment=Deployment(threads=1, num_prefill=1, local_prefill_threshold=256)),
    Load(name="replicas-mixed", bench_args=MIXED, deployment=Deployment(threads=1, num_decode=2)),
    Load(name="colocated-mixed", bench_args=MIXED, deployment=Deployment(threads=2, max_num_batched_tokens=256)),
]


def compare(measured: dict, sim: Summary, engines_only: Summary, wall_s: float) -> dict:
    row: dict = {}
    for metric in ("ttft_ms", "tpot_ms"):
        for p in ("p50", "p99"):
            real = measured[metric][p]
            model, bare = (getattr(getattr(x, metric), p) for x in (sim, engines_only))
            row[f"{metric}_{p}"] = {"measured": real, "simulated": model, "engines_only": bare,
                                    "error": (model - real) / real if real else None,
                                    "engines_only_error": (bare - real) / real if real else None}
    row["sim_wall_s"] = wall_s
    return row


def write_report(doc: dict, path: Path) -> None:
    lines = ["# Simulator validation: simulated vs measured latency on this machine", "",
             f"Command: `{doc['command']}`", "",
             f"Measured {doc['started']} (simulated {doc.get('simulated', doc['started'])}) on {doc['cpu']}, commit "
             f"{doc['commit']}, seed {doc['seed']}, "
             f"{doc['num_prompts']} requests per load; wall {doc['wall_s']:.0f} s.", "",
             "Each load was measured against a real `kvbaton serve`, then its recorded trace (send times, lengths) "
             "was replayed through `kvbaton sim` (5 seeds pooled) with the step-latency model profiled on this "
             "machine and its deployment's calibration, measured on a load of its own (" + CALIBRATION_TEXT
             + "): served steps over profiled ones per role, and the dispatch delay. Targets: |error| "
             f"<= {TARGETS['p50']:.0%} at p50, <= {TARGETS['p99']:.0%} at p99. In brackets: the error of the "
             "engines alone (`kvbaton sim run` without --host-overhead).", "",
             *[f"- {d}: {h}" for d, h in doc["host"].items()], "",
             "| load | metric | measured p50 | sim p50 | error (engines only) | measured p99 | sim p99 | "
             "error (engines only) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in doc["loads"].items():
        if "error" in row and isinstance(row["error"], str):
            lines.append(f"| {name} | failed: {row['error']} | | | | | | |")
            continue
        for metric in ("ttft_ms", "tpot_ms"):
            a, b = row[f"{metric}_p50"], row[f"{metric}_p99"]
            lines.append(f"| {name} | {metric[:4].upper()} ms | {a['measured']:.1f} | {a['simulated']:.1f} | "
                         f"{_pct(a['error'], 'p50')} ({a['engines_only_error']:+.0%}) | {b['measured']:.1f} | "
                         f"{b['simulated']:.1f} | {_pct(b['error'], 'p99')} ({b['engines_only_error']:+.0%}) |")
    path.write_text("\n".join(lines) + "\n")


def _pct(err: float | None, p: str) -> str:
    if err is None:
        return "-"
    return f"{err:+.1%}" + ("" if abs(err) <= TARGETS[p] else " **miss**")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default=",".join(load.name for load in LOADS))
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--profiles-from", type=Path, default=None,
                    help="reuse this CPU kind's sim-profile-*.json and sim-host-*.json from here (a sim-host-*.json "
                         "missing where its calibration run and step traces are: calibrated again on those; "
                         "without them, on a new calibration run)")
    ap.add_argument("--replay", type=Path, default=None, metavar="RUN_JSON",
                    help="simulate a previous run's measured traces (sim-validation-<date>.json, its traces beside "
                         "it) again, e.g. with a refitted step model; measures nothing")
    return ap.parse_args()


def validate(load: Load, trace: Path, profile: Path, host: HostOverhead, pool: tuple[int, int]) -> dict:
    """`load`'s measured run against its replays (calibrated, and the engines alone): its row of the report."""
    measured = read_json(trace)["runs"][0]["summary"]
    summary, wall_s = replay(load.deployment, trace, profile, pool, SLO(), host)
    engines_only, _ = replay(load.deployment, trace, profile, pool, SLO())
    row = compare(measured, summary, engines_only, wall_s)
    print("   " + ", ".join(f"{k} {v['measured']:.1f} vs {v['simulated']:.1f}" for k, v in row.items()
                            if isinstance(v, dict)), flush=True)
    return {**row, "trace": trace.name}


def main() -> None:
    args = parse_args()
    previous = read_json(args.replay) if args.replay else None
    if previous:
        require_traces([args.replay.parent / row["trace"] for row in previous["loads"].values() if "trace" in row])
    from kvbaton.models.registry import pull_default_model

    model_dir = str(pull_default_model())
    seed = previous["seed"] if previous else fresh_seed() if args.seed is None else args.seed
    started = datetime.now()
    run_stamp = stamp(started)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    pool = kv_pool(model_dir, KV_GB)
    names = previous["loads"] if previous else args.loads.split(",")  # a replay: the loads that were measured
    chosen = [load for load in LOADS if load.name in names]
    threads = {load.deployment.threads for load in chosen}
    profiles = {t: ensure_profile(t, RESULTS_DIR, model_dir, args.profiles_from) for t in threads}
    deployments = {load.deployment.label: load.deployment for load in chosen}
    hosts = {label: ensure_host_overhead(d, RESULTS_DIR, model_dir, args.profiles_from, profile=profiles[d.threads],
                                         seed=seed - 1 - i) for i, (label, d) in enumerate(deployments.items())}
    doc = {"started": previous["started"] if previous else started.isoformat(timespec="seconds"),
           "simulated": started.isoformat(timespec="seconds"),
           "command": command_line("bench_sim_validation.py", sys.argv[1:]),
           "commit": kvbaton_commit(), "cpu": f"{cpu_name()} ({cpu_kind()})", "seed": seed,
           "num_prompts": previous["num_prompts"] if previous else args.num_prompts,
           "profiles": {str(t): str(p) for t, p in profiles.items()},
           "host": {label: h.describe() for label, h in hosts.items()}, "loads": {}}
    t0 = time.monotonic()
    for i, load in enumerate(chosen):
        print(f"== {load.name}: kvbaton serve {' '.join(load.deployment.serve_args())}", flush=True)
        try:
            if previous:  # the measured run of before
                trace = args.replay.parent / previous["loads"][load.name]["trace"]
            else:
                trace = measure(load.deployment, load.bench_args, n=args.num_prompts, seed=seed + i,
                                out=RESULTS_DIR / f"sim-validation-{run_stamp}-{load.name}.json", model_dir=model_dir)
        except (RuntimeError, subprocess.CalledProcessError, KeyError) as exc:
            doc["loads"][load.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        doc["loads"][load.name] = validate(load, trace, profiles[load.deployment.threads],
                                           hosts[load.deployment.label], pool)
    doc["wall_s"] = time.monotonic() - t0
    write_json(RESULTS_DIR / f"sim-validation-{run_stamp}.json", doc, indent=1)
    md = RESULTS_DIR / f"sim-validation-{cpu_kind()}.md"
    write_report(doc, md)
    print(md.read_text())


if __name__ == "__main__":
    main()
