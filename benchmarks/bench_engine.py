#!/usr/bin/env python
"""Single-script benchmark of the kvbaton engine against peers measured in the same run.

Model: SmolLM2-135M-Instruct (the default model); every engine gets the same thread count
(2 by default). Three measurements per dtype:

1. memory read bandwidth of this machine (torch, large-tensor sum / copy / matvec) and the
   batch-1 decode roofline: (weight bytes + KV bytes read per step) / read bandwidth;
2. batch-1 latency: a fresh random prompt of `prompt_len` tokens, `out_len` output tokens
   (ignore_eos, greedy): TTFT -> prefill tok/s, mean inter-token time -> decode ms/token;
3. offline throughput: `tp_prompts` random prompts of `prompt_len` tokens, `out_len` output
   tokens each (ignore_eos): output tok/s.

Engines: kvbaton (eager, and `compile=True` where it works), HF transformers `generate`,
vLLM CPU (its OpenAI server, via the peers/ script `vllm-cpu.sh`) and llama.cpp (`llama-bench`
and `llama-server`, via `llama-cpp.sh`); the peers need --peer-scripts / $KVBATON_PEER_SCRIPTS
and --peer-dir / $KVBATON_PEERS_DIR. Prompts are random token ids drawn from a seed printed at
start; every prompt within one engine is distinct, so no prefix or prompt cache can help. Each
engine runs in its own process, one at a time.

    .venv/bin/python benchmarks/bench_engine.py                     # full run, bf16, all peers
    .venv/bin/python benchmarks/bench_engine.py --peers hf --quick  # smoke run

Results: benchmarks/results/engine-<stamp>.json and benchmarks/results/engine.md
(`--quick` runs write engine-quick-<stamp>.json and engine-quick.md instead).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from common.contention import LoadMonitor, note_load, wait_idle
from common.log import log
from common.machine import environment, model_facts, roofline
from common.peers import add_peer_args, resolve_peers
from common.procs import thread_env
from common.prompts import fresh_seed
from common.records import ModelFacts, to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, stamp
from common.workers import WorkerFailed, run_worker, worker_main
from engine_bench.http_peers import run_llamacpp, run_vllm
from engine_bench.inproc import WORKERS
from engine_bench.measure import FULL, QUICK
from engine_bench.report import markdown
from engine_bench.rounds import best_bandwidth, best_of_rounds, highest_read

PEERS = ("hf", "vllm", "llamacpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "both"],
                    help="bfloat16 (default: what kvbaton's dtype=auto picks), float32, or both (~40 min)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="comma-separated subset of hf,vllm,llamacpp ('' or 'none': kvbaton only)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    add_peer_args(ap)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="also measure kvbaton with compile=True: auto = latency only, failures noted; "
                         "on = latency and throughput")
    ap.add_argument("--compute-path", default="auto", help="kvbaton's --compute-path (default: chosen by the CPU)")
    ap.add_argument("--deterministic", default="on", choices=["on", "off"],
                    help="also measure kvbaton with --deterministic (its cost against the default row)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, interleaved (round by round, bandwidth measured at each "
                         "round's start), and report each engine's best figures against the highest bandwidth")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh random, printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=None, help="default: kvbaton's pulled default model")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--wait-idle", type=float, default=120.0,
                    help="before each engine, wait up to this many seconds for other CPU load to go")
    ap.add_argument("--_worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--max-run-s", type=float, default=240.0,
                    help="skip a peer's throughput run when a batched warm-up predicts it takes longer "
                         "(kvbaton's own run always goes)")
    ap.add_argument("--worker-timeout-s", type=float, default=None,
                    help="give up on one engine's process after this long (default: the larger of the "
                         "size preset's limit and 2 x --max-run-s, so a throughput run let through can finish)")
    ap.add_argument("--_compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_deterministic", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_no_tp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    if args.worker_timeout_s is None:
        args.worker_timeout_s = max(args.sizes.worker_timeout_s, 2 * args.max_run_s)
    args.compile_flag = args.compile
    args.compile = args._compile
    args.busy_notes = []
    args.tp = not args._no_tp
    args.always_tp = args._worker == "kvbaton" and not args._compile
    return args


def run_in_worker(kind: str, args: argparse.Namespace, dtype: str | None = None, compile_: bool = False,
                  deterministic: bool = False) -> dict:
    """Run one worker in a fresh process (same interpreter, this script), with its figures of
    the machine's state around it."""
    what = f"{kind} {dtype or ''}{' compile' if compile_ else ''}{' deterministic' if deterministic else ''}".strip()
    busy = wait_idle(args.wait_idle, what, args.busy_notes)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", kind, "--seed", str(args.seed),
           "--threads", str(args.threads), "--model-dir", args.model_dir]
    if args.quick:
        cmd.append("--quick")
    if dtype:
        cmd += ["--dtype", dtype]
    cmd += ["--max-run-s", str(args.max_run_s), "--compute-path", args.compute_path]
    if deterministic:
        cmd.append("--_deterministic")
    if compile_:
        cmd.append("--_compile")
        if args.compile_flag != "on":
            cmd.append("--_no_tp")
    t = time.perf_counter()
    try:
        with args.monitor.window() as window:
            res = run_worker(cmd, thread_env(args.threads), args.worker_timeout_s)
    except WorkerFailed as exc:
        return {"error": str(exc)}
    res["wall_s"] = time.perf_counter() - t
    res["busy_before"] = busy
    note_load(res, what, window, args.busy_notes)
    return res


def run_dtype(args: argparse.Namespace, dtype: str, facts: ModelFacts, read_bw: float, peers: list[str],
              notes: list[str]) -> dict:
    """Every engine at one dtype, one after another."""
    roof = roofline(facts, dtype, args.sizes.prompt_len, args.sizes.out_len, read_bw)
    dres: dict = {"roofline": to_json(roof)}
    log(f"== {dtype}: roofline {roof.roofline_ms_per_tok:.2f} ms/tok")
    dres["kvbaton"] = run_in_worker("kvbaton", args, dtype)
    if args.deterministic == "on":
        dres["kvbaton_deterministic"] = r = run_in_worker("kvbaton", args, dtype, deterministic=True)
        if "error" in r:
            notes.append(f"kvbaton --deterministic ({dtype}) failed: {r['error'][:300]}")
    if args.compile_flag != "off":
        dres["kvbaton_compile"] = r = run_in_worker("kvbaton", args, dtype, compile_=True)
        if "error" in r:
            notes.append(f"kvbaton compile=True ({dtype}) failed: {r['error'][:300]}")
    if "hf" in peers:
        dres["hf"] = run_in_worker("hf", args, dtype)
    if "vllm" in peers:
        dres["vllm"] = run_vllm(args, dtype, facts.vocab_size)
    if "llamacpp" in peers:
        dres["llamacpp"] = run_llamacpp(args, dtype, facts.vocab_size)
    for name in PEERS:
        r = dres.get(name) or {}
        if "skipped" in r:
            notes.append(f"{name} ({dtype}) skipped: {r['skipped']}")
        elif "error" in r:
            notes.append(f"{name} ({dtype}) error: {r['error'][:300]}")
    return dres


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(lambda: WORKERS[args._worker](args))
        return 0
    started = dt.datetime.now()
    t_start = time.perf_counter()
    peers = [p for p in args.peers.replace(" ", "").split(",") if p and p != "none"]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown peers: {sorted(unknown)}")
    args.peer_paths = resolve_peers(args, peers, leave_out="leave vllm and llamacpp out of --peers")
    if args.seed is None:
        args.seed = fresh_seed()
    if args.model_dir is None:
        from kvbaton.models.registry import pull_default_model

        args.model_dir = str(pull_default_model())
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    log(f"seed {args.seed} · dtypes {dtypes} · peers {peers or ['none']} · sizes {asdict(args.sizes)}")

    facts = model_facts(args.model_dir)
    results = {"started": started.isoformat(timespec="seconds"),
               "command": command_line("bench_engine.py", argv if argv is not None else sys.argv[1:]),
               "seed": args.seed, "threads": args.threads, "sizes": asdict(args.sizes), "model_dir": args.model_dir,
               "model": to_json(facts), "environment": to_json(environment(with_transformers=True)),
               "dtypes": {}, "notes": []}
    args.monitor = LoadMonitor()
    args.monitor.start()
    s = args.sizes
    rounds: list[dict] = []
    for n in range(args.rounds):
        log(f"round {n + 1} of {args.rounds}: measuring memory bandwidth")
        bw = run_in_worker("bandwidth", args)
        log(f"bandwidth: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in bw.items()})}")
        read_bw = bw.get("read_gb_s") or float("nan")
        rounds.append({"bandwidth": bw, "dtypes": {dtype: run_dtype(args, dtype, facts, read_bw, peers,
                                                                     results["notes"]) for dtype in dtypes}})
    results["bandwidth"] = best_bandwidth([r["bandwidth"] for r in rounds])
    read_bw = highest_read(rounds)
    results["rooflines"] = {d: to_json(roofline(facts, d, s.prompt_len, s.out_len, read_bw))
                            for d in ("bfloat16", "float32")}
    for dtype in dtypes:
        results["dtypes"][dtype] = best_of_rounds([r["dtypes"][dtype] for r in rounds], results["rooflines"][dtype])
    if args.rounds > 1:
        results["rounds"] = rounds

    results["notes"] += args.busy_notes
    results["wall_s"] = time.perf_counter() - t_start
    files = ResultFiles.of(Path(args.out_dir), "engine-quick" if args.quick else "engine", stamp(started))
    files.write(results, markdown(results), results["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
