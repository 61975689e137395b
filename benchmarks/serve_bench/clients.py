"""The two load generators: ours (`kvbaton bench serve`) against every server, and vLLM's own
(`vllm bench serve`) against kvbaton's for the (c) cross-check. Each run becomes a ServeRun."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.contention import OverlapWatch
from common.log import log
from common.machine import MODEL_NAME, ROOT
from common.procs import thread_env
from common.records import ServeRun, to_json
from common.report import fmt
from common.servers import Server
from serve_bench.plan import SEED_OFFSET, workload
from serve_bench.turns import FOREIGN_BENCH_PATTERN, over_budget, run_cap, wait_turn


def ours_stats(s: dict) -> dict[str, Any]:
    """ServeRun's figures from our load generator's summary."""
    return {"completed": s["completed"], "planned": s["num_planned"], "failed": s["failed"],
            "rejected": s["rejected"], "cancelled": s["cancelled"], "duration_s": s["duration_s"],
            "input_tokens": s["total_input_tokens"], "output_tokens": s["total_output_tokens"],
            "req_s": s["request_throughput"], "output_tok_s": s["output_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "tpot_p50_ms": s["tpot_ms"]["p50"],
            "tpot_p99_ms": s["tpot_ms"]["p99"], "tpot_mean_ms": s["tpot_ms"]["mean"],
            "itl_p50_ms": s["itl_ms"]["p50"], "e2e_p50_ms": s["e2e_ms"]["p50"]}


def vllm_stats(r: dict, planned: int) -> dict[str, Any]:
    """ServeRun's figures from `vllm bench serve`'s result file (older builds say median_*)."""
    return {"completed": r["completed"], "planned": planned, "failed": r.get("failed", 0), "rejected": 0,
            "cancelled": 0, "duration_s": r["duration"], "input_tokens": r["total_input_tokens"],
            "output_tokens": r["total_output_tokens"], "req_s": r["request_throughput"],
            "output_tok_s": r["output_throughput"],
            "ttft_p50_ms": r.get("p50_ttft_ms", r.get("median_ttft_ms")), "ttft_p99_ms": r.get("p99_ttft_ms"),
            "ttft_mean_ms": r.get("mean_ttft_ms"), "tpot_p50_ms": r.get("p50_tpot_ms", r.get("median_tpot_ms")),
            "tpot_p99_ms": r.get("p99_tpot_ms"), "tpot_mean_ms": r.get("mean_tpot_ms"),
            "itl_p50_ms": r.get("p50_itl_ms"), "e2e_p50_ms": r.get("p50_e2el_ms")}


def fmt_summary(r: ServeRun) -> str:
    return (f"{r.completed}/{r.planned} ok, {r.output_tok_s:.1f} out tok/s, TTFT p50/p99 "
            f"{fmt(r.ttft_p50_ms, '.0f')}/{fmt(r.ttft_p99_ms, '.0f')} ms, TPOT p50/p99 "
            f"{fmt(r.tpot_p50_ms, '.1f')}/{fmt(r.tpot_p99_ms, '.1f')} ms, {r.duration_s:.0f}s")


def _run_client(args: argparse.Namespace, cmd: list[str], timeout_s: float, cwd: Path,
                log_path: Path) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """Run a load generator with an eye out for other benchmarks; keep its output in `log_path`.
    Returns (the process, its wall time, the other benchmarks seen meanwhile)."""
    t = time.perf_counter()
    with OverlapWatch(FOREIGN_BENCH_PATTERN) as watch:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads), cwd=cwd,
                              timeout=timeout_s)
    log_path.write_text(proc.stdout + proc.stderr)
    return proc, time.perf_counter() - t, watch.seen


def run_ours(args: argparse.Namespace, server: Server, engine: str, name: str, warmups: int) -> dict:
    """One `kvbaton bench serve` run; returns its ServeRun (or an error)."""
    s, w = args.sizes, workload(args.sizes, name)
    seed = args.seed + SEED_OFFSET[name]
    busy = wait_turn(args, f"{engine} {name}")
    if skip := over_budget(args, f"{engine} {name}"):
        return skip | {"seed": seed}
    cap = run_cap(args)
    out = args.raw_dir / f"{engine}-{name}.json"
    cmd = [sys.executable, "-m", "kvbaton.bench", "serve", "--base-url", server.base_url,
           "--dataset", "random", "--input-len", str(s.input_len), "--output-len", str(s.output_len),
           "--num-prompts", str(w.prompts), "--tokenizer", args.model_dir, "--ignore-eos", "--seed", str(seed),
           "--max-duration-s", str(cap), "--num-warmups", str(warmups), "--result-json", str(out),
           "--no-progress"]
    if not math.isinf(w.rate):
        cmd += ["--request-rate", f"{w.rate:g}"]
    if w.concurrency:
        cmd += ["--max-concurrency", str(w.concurrency)]
    log(f"{engine} {name}: seed {seed}: {shlex.join(cmd[1:])}")
    try:
        proc, wall, seen = _run_client(args, cmd, cap + 300, ROOT, args.raw_dir / f"{engine}-{name}.log")
    except subprocess.TimeoutExpired:
        return {"error": f"load generator timed out after {cap + 300}s", "seed": seed}
    if proc.returncode != 0 or not out.exists():
        return {"error": f"kvbaton bench serve exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}",
                "seed": seed}
    run = json.loads(out.read_text())["runs"][0]
    first_err = next((r["error"] for r in run["records"] if r.get("error")), "")
    res = ServeRun(client="kvbaton bench serve", seed=seed, input_len=s.input_len, cap_s=cap,
                   command=shlex.join(["python", *cmd[1:]]), raw=str(out), wall_s=wall, busy_before=busy,
                   overlap=seen, **ours_stats(run["summary"]), first_error=first_err[:300] or None)
    log(f"{engine} {name}: {fmt_summary(res)}")
    return to_json(res)


def run_vllm_client(args: argparse.Namespace, server: Server, engine: str) -> dict:
    """vLLM's own client (`vllm bench serve`) against `server` on the (c) workload."""
    s, w = args.sizes, workload(args.sizes, "cmp-vllm")
    seed = args.seed + SEED_OFFSET["cmp-vllm"]
    busy = wait_turn(args, f"{engine} vllm-client")
    if skip := over_budget(args, f"{engine} vllm-client"):
        return skip | {"seed": seed}
    cap = run_cap(args)
    fname = f"{engine}-cmp-vllm.json"
    cmd = args.peer_paths.vllm_bench_cmd([
        "--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
        "--model", MODEL_NAME, "--tokenizer", args.model_dir, "--dataset-name", "random",
        "--random-input-len", str(s.input_len), "--random-output-len", str(s.output_len),
        "--random-range-ratio", "0", "--num-prompts", str(w.prompts), "--request-rate", f"{w.rate:g}",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(args.raw_dir), "--result-filename", fname, "--disable-tqdm"])
    log(f"{engine} cmp-vllm (vLLM's client): seed {seed}")
    try:  # vLLM's client has no duration cap of its own: a time-out ends it (+ its start-up)
        proc, wall, seen = _run_client(args, cmd, cap + 120, args.raw_dir, args.raw_dir / f"{engine}-cmp-vllm.log")
    except subprocess.TimeoutExpired:
        return {"error": f"vllm bench serve did not finish in {cap + 120}s", "seed": seed}
    out = args.raw_dir / fname
    if proc.returncode != 0 or not out.exists():
        return {"error": f"vllm bench serve exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}",
                "seed": seed}
    res = ServeRun(client="vllm bench serve", seed=seed, input_len=s.input_len, command=shlex.join(cmd),
                   raw=str(out), wall_s=wall, busy_before=busy, overlap=seen,
                   **vllm_stats(json.loads(out.read_text()), w.prompts))
    log(f"{engine} cmp-vllm: {fmt_summary(res)}")
    return to_json(res)
