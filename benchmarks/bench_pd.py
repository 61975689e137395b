"""Disaggregated vs colocated serving on the mixed long/short workload, in one run.

    .venv/bin/python benchmarks/bench_pd.py            # full run (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_pd.py --quick    # smoke run (~4 min)

Three set-ups of `kvbaton serve` on the default model (bf16), each given this machine's 2 cores:

    pd        --prefill 1 --decode 1 --threads 1   (long prompts prefilled on the prefill worker,
                                                    KV over shm; short ones on the decode worker)
    replicas  --decode 2 --threads 1               (two colocated replicas behind the same router)
    single    --threads 2 --max-num-batched-tokens 256   (one worker, chunked prefill)

and, named in --setups, the adaptive local-prefill threshold: `pd-local` (every prompt prefilled on the
decode worker), and the same under `serve --autoscale --adapt-threshold` at a TPOT SLO of 100 ms
(`pd-adaptive`) or 50 ms (`pd-adaptive-tight`); their routing and threshold changes are reported.

The same `kvbaton bench serve --dataset mixed` workload (same seed: the same prompts and
arrival times) runs against each, one after another, nothing else on the machine. Reported:
TTFT and TPOT p50/p99 and goodput (requests/s meeting both SLOs, DistServe's definition)
at a tight and a loose TPOT SLO, plus each set-up's ratio against `single`.
Writes benchmarks/results/pd-<date>.json and benchmarks/results/pd.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from common.machine import kvbaton_commit
from common.prompts import fresh_seed
from common.records import PdWorkload, SetupScore, to_json
from common.report import RESULTS_DIR, command_line, read_json, stamp, write_json
from common.servers import Server, free_port, kvbaton_server

SETUPS = {
    "pd": ["--prefill", "1", "--decode", "1", "--threads", "1", "--kv-transport", "shm",
           "--local-prefill-threshold", "256"],
    "replicas": ["--decode", "2", "--threads", "1"],
    "single": ["--threads", "2", "--max-num-batched-tokens", "256"],
    # the adaptive threshold's start: every prompt prefilled on the decode worker
    "pd-local": ["--prefill", "1", "--decode", "1", "--threads", "1", "--kv-transport", "shm",
                 "--local-prefill-threshold", "2048"],
}


def adaptive(slo_tpot_ms: int) -> list[str]:
    """pd-local under `--adapt-threshold`: the threshold halves while local prefills slow decoding near the TPOT
    SLO (both pools pinned to one worker, so nothing else moves)."""
    return [*SETUPS["pd-local"], "--autoscale", "--slo-ttft-ms", "10000", "--slo-tpot-ms", str(slo_tpot_ms),
            "--min-prefill", "1", "--max-prefill", "1", "--min-decode", "1", "--max-decode", "1", "--adapt-threshold",
            "--min-local-prefill-threshold", "64", "--max-local-prefill-threshold", "2048", "--autoscale-interval",
            "5", "--autoscale-cooldown", "10", "--autoscale-window", "30"]


SETUPS["pd-adaptive"] = adaptive(100)
SETUPS["pd-adaptive-tight"] = adaptive(50)  # an SLO the all-local start misses by more: the threshold must move
COMMON_ARGS = ["--dtype", "bfloat16", "--max-model-len", "4096", "--kv-cache-memory-gb", "2"]


def run_load(base: str, w: PdWorkload, out_json: Path, tokenizer_dir: str) -> dict:
    cmd = [sys.executable, "-m", "kvbaton.cli", "bench", "serve", "--base-url", base, "--dataset", "mixed",
           "--num-prompts", str(w.num_prompts), "--long-fraction", str(w.long_fraction),
           "--long-input-len", str(w.long_len), "--short-input-len", str(w.short_len),
           "--output-len", str(w.output_len), "--ignore-eos", "--request-rate", str(w.rate),
           "--seed", str(w.seed), "--tokenizer", tokenizer_dir, "--num-warmups", "2",
           "--result-json", str(out_json), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return read_json(out_json)["runs"][0]


def score(run: dict, w: PdWorkload, server_args: list[str], workers: list) -> SetupScore:
    ok = [r for r in run["records"] if r["status"] == "ok"]

    def tpot_ms(r: dict) -> float:
        return (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3

    ttft = np.array([r["ttft_s"] * 1e3 for r in ok])
    tpot = np.array([tpot_ms(r) for r in ok if r["output_tokens"] > 1])
    duration = run["summary"]["duration_s"]
    goodput = {}
    for slo in w.tpot_slos_ms:
        good = sum(1 for r in ok if r["output_tokens"] > 1 and r["ttft_s"] * 1e3 <= w.ttft_slo_ms
                   and tpot_ms(r) <= slo)
        goodput[str(slo)] = good / duration
    return SetupScore(completed=len(ok), planned=len(run["records"]), duration_s=duration,
                      ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                      tpot_p50=float(np.percentile(tpot, 50)), tpot_p99=float(np.percentile(tpot, 99)),
                      out_tok_s=run["summary"]["output_throughput"], goodput=goodput, server_args=server_args,
                      workers=workers)


def write_report(doc: dict, path: Path) -> None:
    a = doc["args"]
    slos = [str(s) for s in a["tpot_slos_ms"]]
    lines = [f"# kvbaton PD disaggregation benchmark — {doc['started']}", "",
             f"Command: `{doc['command']}`  ", f"kvbaton commit {doc['commit']} · seed {a['seed']} · wall "
             f"{doc['wall_s'] / 60:.1f} min", "",
             f"Workload: `kvbaton bench serve --dataset mixed`: {a['num_prompts']} requests, "
             f"Poisson {a['rate']} req/s, "
             f"{a['long_fraction']:.0%} long prompts of {a['long_len']} tokens among short ones of {a['short_len']}, "
             f"{a['output_len']} output tokens each (ignore_eos), default model bf16, 2 cores per set-up. "
             f"Goodput: requests/s with TTFT ≤ {a['ttft_slo_ms']:.0f} ms and TPOT ≤ the SLO.", "",
             "| set-up | completed | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
             + " | ".join(f"goodput @TPOT≤{s} ms" for s in slos) + " |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(slos)]
    for name, row in doc["setups"].items():
        if "error" in row:
            lines.append(f"| {name} | error: {row['error']} |")
            continue
        lines.append(f"| {name} | {row['completed']}/{row['planned']} | {row['out_tok_s']:.1f} | "
                     f"{row['ttft_p50']:.0f} | {row['ttft_p99']:.0f} | {row['tpot_p50']:.1f} | {row['tpot_p99']:.1f} | "
                     + " | ".join(f"{row['goodput'][s]:.3f}" for s in slos) + " |")
    base = doc["setups"].get("single", {})
    if "tpot_p99" in base:
        lines += ["", "Ratios against `single` (TPOT p99: lower is better; goodput: higher is better):", ""]
        for name, row in doc["setups"].items():
            if name == "single" or "error" in row:
                continue
            gp = ", ".join(f"goodput@{s} {row['goodput'][s] / base['goodput'][s]:.2f}x" if base["goodput"][s] else
                           f"goodput@{s} {row['goodput'][s]:.3f} vs 0" for s in slos)
            lines.append(f"- {name}: TPOT p99 {row['tpot_p99'] / base['tpot_p99']:.2f}x, "
                         f"TTFT p99 {row['ttft_p99'] / base['ttft_p99']:.2f}x, {gp}")
    routed = {name: row["routing"] for name, row in doc["setups"].items() if "routing" in row}
    if routed:
        lines += ["", "PD routing (requests through the prefill worker / prefilled locally; the threshold at the "
                  "end, and its changes under `--adapt-threshold`):", ""]
        for name, r in routed.items():
            changes = "; ".join(r.get("threshold_changes", [])) or "none"
            lines.append(f"- {name}: {r['disaggregated']} / {r['local']}, threshold {r['threshold_at_end']}; "
                         f"changes: {changes}")
    path.write_text("\n".join(lines) + "\n")


def parse_args() -> PdWorkload:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--setups", default="pd,replicas,single")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None, help="workload seed (default: fresh random, printed)")
    ap.add_argument("--tpot-slos-ms", default="150,300", help="comma-separated TPOT SLOs for goodput")
    ap.add_argument("--report", default=None, help="the markdown report's name in benchmarks/results "
                                                   "(default pd.md, or pd-quick.md with --quick)")
    args = ap.parse_args()
    # NOTE: the rate is below saturation on 2 cores (at 1 req/s every set-up queues and TPOT is
    # queueing, not interference); the question is what a long prefill does to the decodes around it.
    return PdWorkload(quick=args.quick, setups=args.setups, num_prompts=args.num_prompts or (16 if args.quick else 40),
                      rate=args.rate or 0.4, seed=fresh_seed() if args.seed is None else args.seed,
                      tpot_slos_ms=[float(x) for x in args.tpot_slos_ms.split(",")], long_fraction=0.15,
                      long_len=512 if args.quick else 1024, short_len=64, output_len=32 if args.quick else 64,
                      ttft_slo_ms=10_000.0, report=args.report)


def run_setup(name: str, w: PdWorkload, run_stamp: str, model_dir: str) -> dict:
    """One set-up: start it, drive it, score it, stop it by PID."""
    print(f"== {name}: kvbaton serve {' '.join(SETUPS[name])}", flush=True)
    port = free_port()
    # NOTE: the servers get this environment as it is (no thread variables): each set-up splits
    # the cores itself with --threads, per worker.
    spec = kvbaton_server(name=f"kvbaton serve ({name})", port=port, serve_args=[*COMMON_ARGS, *SETUPS[name]],
                          log_path=RESULTS_DIR / f"pd-{run_stamp}-{name}.log", env=dict(os.environ),
                          timeout_s=300, health_path="/health")
    try:
        with Server(spec) as server:
            run = run_load(server.base_url, w, RESULTS_DIR / f"pd-{run_stamp}-{name}-load.json", model_dir)
            workers = httpx.get(f"{server.base_url}/workers", timeout=5, trust_env=False).json()["workers"]
            row = score(run, w, SETUPS[name], workers)
            routing = _routing(server.base_url) if "--prefill" in SETUPS[name] else None
    except RuntimeError as exc:  # did not start
        return {"error": str(exc)}
    except (subprocess.CalledProcessError, KeyError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    print(f"   TTFT p50/p99 {row.ttft_p50:.0f}/{row.ttft_p99:.0f} ms, TPOT p50/p99 "
          f"{row.tpot_p50:.1f}/{row.tpot_p99:.1f} ms, goodput {row.goodput}", flush=True)
    if routing is not None:
        print(f"   routing {routing}", flush=True)
    return {**to_json(row), **({"routing": routing} if routing is not None else {})}


def _routing(base: str) -> dict:
    """A PD set-up's routing counters and threshold, and (with --adapt-threshold) the threshold's changes."""
    r = httpx.get(f"{base}/admin/diagnostics/routing", timeout=5, trust_env=False).json()
    out = {"threshold_at_end": r["local_prefill_threshold"], "disaggregated": r["counters"]["disaggregated"],
           "local": r["counters"]["local"]}
    view = httpx.get(f"{base}/admin/autoscaler", timeout=5, trust_env=False)
    if view.status_code == 200:
        out["threshold_changes"] = [f"{s['from']}->{s['to']}: {s['reason']}" for s in view.json()["scaling"]
                                    if s["pool"] == "local_prefill_threshold"]
    return out


def main() -> None:
    w = parse_args()
    print(f"bench_pd: seed {w.seed}", flush=True)
    from kvbaton.models.registry import pull_default_model

    model_dir = str(pull_default_model())
    started = datetime.now()
    run_stamp = stamp(started)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    doc = {"started": started.isoformat(timespec="seconds"), "command": command_line("bench_pd.py", sys.argv[1:]),
           "commit": kvbaton_commit(), "args": to_json(w), "setups": {}}
    t0 = time.monotonic()
    for name in w.setups.split(","):
        doc["setups"][name] = run_setup(name, w, run_stamp, model_dir)
    doc["wall_s"] = time.monotonic() - t0
    write_json(RESULTS_DIR / f"pd-{run_stamp}.json", doc, indent=1)
    md = RESULTS_DIR / (w.report or ("pd-quick.md" if w.quick else "pd.md"))
    write_report(doc, md)
    print(md.read_text())


if __name__ == "__main__":
    main()
