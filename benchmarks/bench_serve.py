#!/usr/bin/env python
"""Serving benchmark: `kvbaton serve` against vLLM CPU and llama.cpp's llama-server, in one run.

Every engine serves the default model (SmolLM2-135M-Instruct, bf16) with 2 threads, one at a
time, on 127.0.0.1, and is driven by our load generator `kvbaton bench serve` (streaming
/v1/completions, a fresh connection per request):

  (a) poisson    - Poisson arrivals at 2 req/s
  (b) saturated  - all requests offered at once, a cap on the number in flight

Each request: a random prompt of exactly 512 tokens (random token ids, measured with the
model's tokenizer) and 128 output tokens (ignore_eos, greedy). Reported per engine: output
tok/s, TTFT p50/p99, TPOT p50/p99, and kvbaton's figures over each peer's.

Two more checks on the kvbaton server:
  (c) client cross-check - vLLM's own client (`vllm bench serve`) and ours (twice, for the
      run-to-run noise) on the same workload shape (Poisson 2 req/s): do the clients agree?
  (d) serving overhead   - kvbaton offline (`LLM.generate`) on exactly the prompts of (b),
      vs kvbaton served at (b): served / offline output tok/s (target >= 90%).

Sizes: default 16 requests per workload, at most 8 in flight in (b) (~30 min on 2 cores,
where vLLM's bf16 path prefills ~50 tok/s); `--num-prompts 64 --sat-concurrency 32
--cmp-prompts 32` is the 64-request shape (over an hour there). Engines run peers first and
kvbaton last, so that (c) and (d) are what `--budget-min` drops when time runs out.

Seeds: one base seed per run (fresh unless --seed; printed). Each workload gets its own seed
(base + 100 * k), the same for every engine, so all engines see identical prompts, while no
two workloads on one server share a prompt (no prefix or prompt cache can help).

    .venv/bin/python benchmarks/bench_serve.py                          # full run, all engines
    .venv/bin/python benchmarks/bench_serve.py --quick --engines kvbaton  # smoke run (~4 min)

Results: benchmarks/results/serve-<stamp>.json and benchmarks/results/serve.md (`--quick`:
serve-quick-<stamp>.json and serve-quick.md). Raw per-run files of the load generators and
server logs go to --raw-dir (default: kvbaton-bench-serve-<stamp> in the temporary directory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import NoReturn

from common.contention import take_lock
from common.log import log
from common.machine import MODEL_NAME, environment
from common.peers import PEER_SCRIPTS_ENV, PEERS_DIR_ENV, add_peer_args, resolve_peers
from common.procs import thread_env
from common.prompts import fresh_seed
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, stamp
from common.servers import Server, ServerSpec, free_port, kvbaton_server
from common.workers import worker_main
from serve_bench.clients import run_ours, run_vllm_client
from serve_bench.offline import run_offline, worker_offline
from serve_bench.plan import ENGINES, FULL, QUICK, SEED_HEADROOM, SEED_OFFSET, Sizes
from serve_bench.report import markdown, summarize
from serve_bench.turns import over_budget, wait_turn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of kvbaton,vllm,llamacpp")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: fresh random, printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-slots", type=int, default=8, help="llama-server parallel slots")
    ap.add_argument("--no-client-check", dest="client_check", action="store_false",
                    help="skip (c), the vLLM-client cross-check")
    ap.add_argument("--client-check-repeat", action=argparse.BooleanOptionalAction, default=True,
                    help="(c): run our client a second time, for the run-to-run noise (default on)")
    ap.add_argument("--no-offline", dest="offline", action="store_false", help="skip (d), the offline run")
    ap.add_argument("--model-dir", default=None, help="default: kvbaton's pulled default model")
    add_peer_args(ap)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--raw-dir", type=Path, default=None,
                    help="per-run load-generator JSONs and server logs (default: kvbaton-bench-serve-<stamp> "
                         "in the system's temporary directory)")
    ap.add_argument("--wait-idle", type=float, default=120.0,
                    help="before each measurement, wait up to this many seconds for other CPU load to go")
    ap.add_argument("--wait-foreign", type=float, default=3600.0,
                    help="wait up to this many seconds for another benchmarks/bench_*.py to finish, then stop")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests in (a) and (b) (full: 64)")
    ap.add_argument("--sat-concurrency", type=int, default=None, help="(b) and (d): requests in flight (full: 32)")
    ap.add_argument("--cmp-prompts", type=int, default=None, help="requests per client in (c) (full: 32)")
    ap.add_argument("--run-cap-s", type=int, default=None,
                    help="cap on every load-generator run, seconds (full: 420); requests still running are cut off")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="time budget (minutes, not counting waits for the machine): a stage that would start "
                         "with too little left is skipped with a note, runs are capped to what is left "
                         "(default: 35 full, 15 quick)")
    ap.add_argument("--_worker", choices=["offline"], help=argparse.SUPPRESS)
    ap.add_argument("--_sizes", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    overrides = {"poisson_prompts": args.num_prompts, "sat_prompts": args.num_prompts,
                 "sat_concurrency": args.sat_concurrency, "cmp_prompts": args.cmp_prompts,
                 "run_cap_s": args.run_cap_s}
    args.sizes = replace(args.sizes, **{k: v for k, v in overrides.items() if v is not None})
    if args._sizes:  # a worker gets the orchestrator's sizes
        args.sizes = Sizes(**json.loads(args._sizes))
    args.notes = []
    if args.budget_min is None:
        args.budget_min = 15.0 if args.quick else 35.0
    args.budget_min = args.budget_min if args.budget_min > 0 else None
    args.t_start, args.waited_s = time.perf_counter(), 0.0
    return args


def engine_server(args: argparse.Namespace, engine: str, port: int, gguf: Path | None) -> ServerSpec:
    if engine == "kvbaton":
        serve_args = ["--model", args.model_dir, "--threads", str(args.threads), "--served-model-name", MODEL_NAME]
        return kvbaton_server(name="kvbaton", port=port, serve_args=serve_args,
                              log_path=args.raw_dir / f"kvbaton-serve-{port}.log", env=thread_env(args.threads),
                              timeout_s=args.sizes.server_start_s)
    peers, timeout_s = args.peer_paths, args.sizes.server_start_s
    if engine == "vllm":
        return peers.vllm_server(model_dir=args.model_dir, port=port, dtype="bfloat16", threads=args.threads,
                                 timeout_s=timeout_s)
    return peers.llama_server(gguf=gguf, port=port, slots=args.llama_slots, threads=args.threads,
                              timeout_s=timeout_s)


def llama_gguf(args: argparse.Namespace) -> Path:
    """The BF16 GGUF llama-server runs (shared with bench_engine.py), converted once if missing."""
    if not args.peer_paths.gguf_path("bfloat16").exists():
        wait_turn(args, "the GGUF conversion")
    return args.peer_paths.ensure_gguf(args.model_dir, "bfloat16", args.threads)


def peer_missing(args: argparse.Namespace, engine: str) -> str | None:
    if engine == "kvbaton":
        return None
    if args.peer_paths is None:
        return f"peers not located: give --peer-scripts and --peer-dir (or ${PEER_SCRIPTS_ENV}, ${PEERS_DIR_ENV})"
    return args.peer_paths.missing(engine)


def run_engine(args: argparse.Namespace, engine: str) -> dict:
    if missing := peer_missing(args, engine):
        return {"skipped": missing}
    if skip := over_budget(args, f"starting {engine}", 180):
        return skip
    gguf = llama_gguf(args) if engine == "llamacpp" else None
    wait_turn(args, f"starting {engine}")
    port = free_port()
    spec = engine_server(args, engine, port, gguf)
    res: dict = {"port": port, "log": str(spec.log_path), "runs": {}}
    if gguf:
        res["gguf"] = str(gguf)
    with Server(spec) as server:
        res["startup_s"] = server.startup_s
        first = True
        for name in ("poisson", "saturated"):
            res["runs"][name] = run_ours(args, server, engine, name, args.sizes.warmups if first else 0)
            first = False
        if engine == "kvbaton" and args.client_check:
            if missing := peer_missing(args, "vllm"):
                res["runs"]["cmp-vllm"] = {"skipped": missing}
            else:  # ours, vLLM's, ours again: the two runs of ours show the run-to-run noise
                res["runs"]["cmp-ours"] = run_ours(args, server, engine, "cmp-ours", 0)
                res["runs"]["cmp-vllm"] = run_vllm_client(args, server, engine)
                if args.client_check_repeat:  # fresh prompts again (no prefix-cache hits)
                    res["runs"]["cmp-ours-2"] = run_ours(args, server, engine, "cmp-ours-2", 0)
    return res


def run_notes(results: dict, notes: list[str]) -> None:
    """What the summary must say about runs that were skipped, failed or overlapped."""
    for e, r in results["engines"].items():
        if "skipped" in r:
            notes.append(f"{e} skipped: {r['skipped']}")
        for name, run in r.get("runs", {}).items():
            if run.get("overlap"):
                notes.append(f"{e} {name}: another benchmark ran at the same time: {run['overlap'][0]}")
            if "error" in run or "skipped" in run:
                notes.append(f"{e} {name}: {(run.get('error') or run.get('skipped'))[:300]}")
    off = results.get("offline") or {}
    if off.get("overlap"):
        notes.append(f"kvbaton offline: another benchmark ran at the same time: {off['overlap'][0]}")
    if off.get("busy_before", 0) > 0.15:
        notes.append(f"kvbaton offline: machine {off['busy_before']:.0%} busy before")


def _terminate(signum: int, frame: object) -> NoReturn:  # SIGTERM / SIGHUP: unwind, so every `finally` stops
    raise SystemExit(128 + signum)


def run_engines(args: argparse.Namespace, engines: list[str], results: dict, files: ResultFiles,
                ) -> BaseException | None:
    """Each engine in turn (kvbaton offline after its server is gone), the results checkpointed after each; a
    failed engine is recorded and the next one runs. Ctrl-C or a signal ends the runs early: returned, with the
    partial results kept."""
    try:
        for engine in engines:
            log(f"== {engine}")
            try:
                results["engines"][engine] = run_engine(args, engine)
            except Exception as exc:  # recorded, and the next engine still runs
                results["engines"][engine] = {"error": f"{type(exc).__name__}: {exc}"}
                args.notes.append(f"{engine}: {type(exc).__name__}: {str(exc)[:300]}")
                log(f"{engine} failed: {exc}")
            if engine == "kvbaton" and args.offline:  # after the server is gone: one engine at a time
                results["offline"] = run_offline(args)
            files.write_json(results)  # a checkpoint
    except (KeyboardInterrupt, SystemExit) as exc:
        args.notes.append(f"interrupted ({type(exc).__name__}); partial results")
        return exc
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_dir is None:
        from kvbaton.models.registry import pull_default_model

        args.model_dir = str(pull_default_model())
    if args._worker:
        worker_main(lambda: worker_offline(args))
        return 0
    engines = [e for e in args.engines.replace(" ", "").split(",") if e]
    if set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines: {sorted(set(engines) - set(ENGINES))}; choose from {ENGINES}")
    args.peer_paths = resolve_peers(args, engines, leave_out="leave vllm and llamacpp out of --engines")
    wait_turn(args, "the start")  # even loading torch would disturb another benchmark on 2 cores
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    started = dt.datetime.now()
    run_stamp = stamp(started)
    t_start = time.perf_counter()
    if args.seed is None:
        args.seed = fresh_seed(SEED_HEADROOM)
    # peers first, kvbaton last: its extra checks (c, d) come after every engine's (a) and (b),
    # so a run that hits --budget-min loses those, not a peer's figures
    engines = sorted(dict.fromkeys(engines), key=lambda e: e == "kvbaton")
    lock = take_lock(args.wait_foreign)
    args.raw_dir = (args.raw_dir or Path(tempfile.gettempdir()) / f"kvbaton-bench-serve-{run_stamp}").resolve()
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench_serve: base seed {args.seed} (workload seeds: "
          + ", ".join(f"{k} {args.seed + v}" for k, v in SEED_OFFSET.items()) + ")", flush=True)
    log(f"engines {engines} · sizes {asdict(args.sizes)} · raw files in {args.raw_dir}")

    peer_versions = args.peer_paths.versions() if args.peer_paths else {}
    results = {"started": started.isoformat(timespec="seconds"),
               "command": command_line("bench_serve.py", argv if argv is not None else sys.argv[1:]),
               "seed": args.seed, "seeds": {k: args.seed + v for k, v in SEED_OFFSET.items()},
               "threads": args.threads, "llama_slots": args.llama_slots, "sizes": asdict(args.sizes),
               "model_dir": args.model_dir, "raw_dir": str(args.raw_dir), "engine_order": engines,
               "environment": to_json(environment(peers=peer_versions)), "engines": {}, "notes": args.notes}
    files = ResultFiles.of(args.out_dir, "serve-quick" if args.quick else "serve", run_stamp)
    interrupted = run_engines(args, engines, results, files)
    results["wall_s"] = time.perf_counter() - t_start
    summarize(results)
    run_notes(results, args.notes)
    files.write(results, markdown(results), results["wall_s"])
    lock.close()
    return 130 if interrupted is not None else 0


if __name__ == "__main__":
    sys.exit(main())
