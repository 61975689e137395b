"""A long soak of one `kvbaton serve`: the mixed load of tests/soak/test_soak.py, for longer.

    .venv/bin/python benchmarks/soak.py                      # 600 s of load, colocated
    .venv/bin/python benchmarks/soak.py --duration-s 120 --serve-args="--prefill 1 --decode 2"

The load is kvbaton/bench/soak.py: whole and streamed requests, streams cut mid-way,
requests abandoned before their answer, stop strings; fresh random prompts from `--seed`.
A warm-up round (`--warmup-s`) comes first. Printed: requests by kind and outcome, HTTP
statuses, errors, p50/p99 end-to-end latency of the served requests, and the RSS of the server
and of every worker after the warm-up and after the soak. Exit status 1 if a request failed,
the server did not return to idle, or a worker was replaced.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from common.log import log
from common.procs import thread_env
from common.servers import Server, free_port, kvbaton_server
from kvbaton.bench.soak import Outcome, SoakConfig, SoakResult, rss_mib, run_soak, stats, wait_idle, workers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of load (after the warm-up)")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a request asks for")
    p.add_argument("--max-prompt-words", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="thread pools of the server and its workers")
    p.add_argument("--serve-args", default="--dtype float32 --max-model-len 1024",
                   help="arguments for `kvbaton serve` (one string)")
    p.add_argument("--log", type=Path, default=Path("/tmp/kvbaton-soak-server.log"))
    return p.parse_args(argv)


def rss_all(server_pid: int, worker_pids: dict[str, int]) -> dict[str, float]:
    return {"server": rss_mib(server_pid), **{name: rss_mib(pid) for name, pid in worker_pids.items()}}


def report(result: SoakResult, load_s: float, before: dict[str, float], after: dict[str, float]) -> None:
    print(f"load: {load_s:.0f}s, {result.summary()}")
    for (kind, outcome), n in sorted(result.counts.items(), key=lambda item: (item[0][0].value, item[0][1].value)):
        print(f"  {kind.value:<12} {outcome.value:<13} {n}")
    print(f"served={result.total(Outcome.SERVED)} errors={len(result.errors)} "
          f"p50={result.percentile_s(50):.2f}s p99={result.percentile_s(99):.2f}s")
    for name in before:
        print(f"RSS {name:<16} {before[name]:8.1f} MiB -> {after[name]:8.1f} MiB  ({after[name] - before[name]:+.1f})")
    for line in result.errors[:20]:
        print(f"  error: {line}")


def soak(base: str, server_pid: int, args: argparse.Namespace) -> int:
    worker_pids = {w["name"]: w["pid"] for w in workers(base)}
    config = dict(concurrency=args.concurrency, max_tokens=args.max_tokens, max_prompt_words=args.max_prompt_words)
    log(f"warm-up {args.warmup_s:.0f}s against {base} (workers {worker_pids})")
    warmup = run_soak(base, SoakConfig(duration_s=args.warmup_s, seed=args.seed, **config))
    idle_before = wait_idle(base, timeout_s=60)
    before = rss_all(server_pid, worker_pids)
    log(f"soak {args.duration_s:.0f}s, seed {args.seed + 1}")
    t = time.monotonic()
    result = run_soak(base, SoakConfig(duration_s=args.duration_s, seed=args.seed + 1, **config))
    load_s = time.monotonic() - t
    idle_after = wait_idle(base, timeout_s=60)
    after = rss_all(server_pid, worker_pids)
    report(result, load_s, before, after)
    now = {w["name"]: w["pid"] for w in workers(base)}
    problems = [*(["not idle after the warm-up"] if idle_before is None else []),
                *([f"not idle after the soak: {stats(base)}"] if idle_after is None else []),
                *([f"workers changed: {worker_pids} -> {now}"] if now != worker_pids else []),
                *([f"{len(warmup.errors) + len(result.errors)} request(s) failed"]
                  if warmup.errors or result.errors else [])]
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    spec = kvbaton_server(name="kvbaton", port=port, serve_args=["--host", "127.0.0.1", *shlex.split(args.serve_args)],
                          log_path=args.log, env=thread_env(args.threads), timeout_s=300, health_path="/health")
    with Server(spec) as server:
        return soak(server.base_url, server.pid, args)


if __name__ == "__main__":
    sys.exit(main())
