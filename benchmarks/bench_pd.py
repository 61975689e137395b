"""Disaggregated vs colocated serving on the mixed long/short workload, in one run.

    .venv/bin/python benchmarks/bench_pd.py            # full run (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_pd.py --quick    # smoke run (~4 min)

Three set-ups of `kvbaton serve` on the default model (bf16), each given this machine's 2 cores:

    pd        --prefill 1 --decode 1 --threads 1   (long prompts prefilled on the prefill worker,
                                                    KV over shm; short ones on the decode worker)
    replicas  --decode 2 --threads 1               (two colocated replicas behind the same router)
    single    --threads 2 --max-num-batched-tokens 256   (one worker, chunked prefill)

The same `kvbaton bench serve --dataset mixed` workload (same seed: the same prompts and
arrival times) runs against each, one after another, nothing else on the machine. Reported:
TTFT and TPOT p50/p99 and goodput (requests/s meeting both SLOs, DistServe's definition)
at a tight and a loose TPOT SLO, plus each set-up's ratio against `single`.
Writes benchmarks/results/pd-<date>.json and benchmarks/results/pd.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

SETUPS = {
    "pd": ["--prefill", "1", "--decode", "1", "--threads", "1", "--kv-transport", "shm",
           "--local-prefill-threshold", "256"],
    "replicas": ["--decode", "2", "--threads", "1"],
    "single": ["--threads", "2", "--max-num-batched-tokens", "256"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", "4096", "--kv-cache-memory-gb", "2", *args]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy in time: see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server (its workers exit with it); SIGKILL its process group if it lingers."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_load(base: str, args, out_json: Path, tokenizer_dir: str) -> dict:
    cmd = [sys.executable, "-m", "kvbaton.cli", "bench", "serve", "--base-url", base, "--dataset", "mixed",
           "--num-prompts", str(args.num_prompts), "--long-fraction", str(args.long_fraction),
           "--long-input-len", str(args.long_len), "--short-input-len", str(args.short_len),
           "--output-len", str(args.output_len), "--ignore-eos", "--request-rate", str(args.rate),
           "--seed", str(args.seed), "--tokenizer", tokenizer_dir, "--num-warmups", "2",
           "--result-json", str(out_json), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out_json.read_text())["runs"][0]


def score(run: dict, tpot_slos_ms: list[float], ttft_slo_ms: float) -> dict:
    ok = [r for r in run["records"] if r["status"] == "ok"]
    ttft = np.array([r["ttft_s"] * 1e3 for r in ok])
    tpot = np.array([(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3 for r in ok
                     if r["output_tokens"] > 1])
    duration = run["summary"]["duration_s"]
    row = {"completed": len(ok), "planned": len(run["records"]), "duration_s": duration,
           "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
           "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99)),
           "out_tok_s": run["summary"]["output_throughput"], "goodput": {}}
    for slo in tpot_slos_ms:
        good = sum(1 for r in ok if r["output_tokens"] > 1 and r["ttft_s"] * 1e3 <= ttft_slo_ms
                   and (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3 <= slo)
        row["goodput"][str(slo)] = good / duration
    return row


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
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--setups", default="pd,replicas,single")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--tpot-slos-ms", default="150,300", help="comma-separated TPOT SLOs for goodput")
    args = ap.parse_args()
    args.num_prompts = args.num_prompts or (16 if args.quick else 40)
    # NOTE: below saturation on 2 cores (at 1 req/s every set-up queues and TPOT is queueing, not
    # interference); the question is what a long prefill does to the decodes around it.
    args.rate = args.rate or 0.4
    args.long_fraction, args.long_len, args.short_len = 0.15, (512 if args.quick else 1024), 64
    args.output_len = 32 if args.quick else 64
    args.tpot_slos_ms, args.ttft_slo_ms = [float(x) for x in args.tpot_slos_ms.split(",")], 10_000.0

    sys.path.insert(0, str(ROOT))
    from kvbaton.models.registry import pull_default_model

    model_dir = str(pull_default_model())
    started = datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    doc = {"started": started.isoformat(timespec="seconds"), "command": " ".join(["python", *sys.argv]),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip(), "args": vars(args), "setups": {}}
    t0 = time.monotonic()
    for name in args.setups.split(","):
        print(f"== {name}: kvbaton serve {' '.join(SETUPS[name])}", flush=True)
        log = RESULTS / f"pd-{stamp}-{name}.log"
        RESULTS.mkdir(parents=True, exist_ok=True)
        try:
            proc, base = start_server(SETUPS[name], log)
        except RuntimeError as exc:
            doc["setups"][name] = {"error": str(exc)}
            continue
        try:
            run = run_load(base, args, RESULTS / f"pd-{stamp}-{name}-load.json", model_dir)
            doc["setups"][name] = score(run, args.tpot_slos_ms, args.ttft_slo_ms) | {"server_args": SETUPS[name]}
            workers = httpx.get(f"{base}/workers", timeout=5).json()
            doc["setups"][name]["workers"] = workers["workers"]
            r = doc["setups"][name]
            print(f"   TTFT p50/p99 {r['ttft_p50']:.0f}/{r['ttft_p99']:.0f} ms, TPOT p50/p99 "
                  f"{r['tpot_p50']:.1f}/{r['tpot_p99']:.1f} ms, goodput {r['goodput']}", flush=True)
        except (subprocess.CalledProcessError, KeyError, ValueError) as exc:
            doc["setups"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            stop_server(proc)
    doc["wall_s"] = time.monotonic() - t0
    out = RESULTS / f"pd-{stamp}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    write_report(doc, RESULTS / ("pd-quick.md" if args.quick else "pd.md"))
    print((RESULTS / ("pd-quick.md" if args.quick else "pd.md")).read_text())


if __name__ == "__main__":
    main()
