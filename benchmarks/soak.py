"""A long soak of one `kvbaton serve`: the mixed load of tests/soak/test_soak.py, for longer.

    .venv/bin/python benchmarks/soak.py                      # 1800 s of load, colocated
    .venv/bin/python benchmarks/soak.py --duration-s 120 --serve-args="--prefill 1 --decode 1"

The load is kvbaton/bench/soak.py: whole and streamed requests, streams cut mid-way and whole
requests abandoned (of 1-4 choices each), n-sampling, structured outputs, tool calls, stop strings;
fresh random prompts from `--seed`. A warm-up round (`--warmup-s`) comes first. During the soak the
RSS and open fds of the server and every worker are sampled every `--sample-s`.

Printed: requests by kind and outcome, HTTP statuses, errors, p50/p99 end-to-end latency of the
served requests, and per process the RSS and private memory (`kvbaton.bench.soak.private_mib`) after
the warm-up and after the soak, their least-squares slopes over the soak, and its open fds at idle
before and after. `--json PATH` writes the same. Exit status 1 if a request failed, the server did not
return to idle (an admission entry left pending is not idle), a worker was replaced, a private-memory
slope reached `--max-slope-mb-min`, or a process holds more fds at idle after the soak than before.
(The RSS slope is printed, not judged: a 1P+1D decode worker's RSS climbs towards the size of the
prefill worker's shm pool, whose pages it touches as it reads KV from more of them.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from common.log import log
from common.procs import thread_env
from common.servers import Server, free_port, kvbaton_server
from kvbaton.bench.soak import (
    Outcome,
    ProcessTrace,
    SoakConfig,
    SoakResult,
    open_fds,
    private_mib,
    rss_mib,
    run_soak,
    stats,
    wait_idle,
    workers,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0, help="seconds of load (after the warm-up)")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a request asks for")
    p.add_argument("--max-prompt-words", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="thread pools of the server and its workers")
    p.add_argument("--sample-s", type=float, default=5.0, help="how often RSS and fds are sampled")
    p.add_argument("--max-slope-mb-min", type=float, default=1.0, help="the RSS slope a process must stay under")
    p.add_argument("--serve-args", default="--dtype float32 --max-model-len 1024",
                   help="arguments for `kvbaton serve` (one string)")
    p.add_argument("--log", type=Path, default=Path("/tmp/kvbaton-soak-server.log"))
    p.add_argument("--json", type=Path, default=None, help="write the figures here too")
    return p.parse_args(argv)


def at_idle(pids: dict[str, int]) -> dict[str, tuple[float, float, int]]:
    return {name: (rss_mib(pid), private_mib(pid), open_fds(pid)) for name, pid in pids.items()}


def report(result: SoakResult, load_s: float, trace: ProcessTrace, before: dict[str, tuple[float, float, int]],
           after: dict[str, tuple[float, float, int]]) -> dict[str, dict[str, float]]:
    print(f"load: {load_s:.0f}s, {result.summary()}")
    for (kind, outcome), n in sorted(result.counts.items(), key=lambda item: (item[0][0].value, item[0][1].value)):
        print(f"  {kind.value:<12} {outcome.value:<13} {n}")
    print(f"served={result.total(Outcome.SERVED)} errors={len(result.errors)} "
          f"p50={result.percentile_s(50):.2f}s p99={result.percentile_s(99):.2f}s")
    figures = {}
    for name in before:
        (rss0, own0, fds0), (rss1, own1, fds1) = before[name], after[name]
        slope, own_slope = trace.slope_mb_per_min(name), trace.slope_mb_per_min(name, private=True)
        fds_min, fds_max = trace.fds_range(name)
        figures[name] = {"rss_before_mib": rss0, "rss_after_mib": rss1, "rss_slope_mb_per_min": slope,
                         "private_before_mib": own0, "private_after_mib": own1,
                         "private_slope_mb_per_min": own_slope,
                         "fds_before": fds0, "fds_after": fds1, "fds_min": fds_min, "fds_max": fds_max}
        print(f"{name:<17} RSS {rss0:7.1f} -> {rss1:7.1f} MiB ({rss1 - rss0:+.1f}, slope {slope:+.3f} MB/min); "
              f"private {own0:7.1f} -> {own1:7.1f} MiB ({own1 - own0:+.1f}, slope {own_slope:+.3f} MB/min); "
              f"fds at idle {fds0} -> {fds1} (under load {fds_min}-{fds_max})")
    for line in result.errors[:20]:
        print(f"  error: {line}")
    return figures


def soak(base: str, server_pid: int, args: argparse.Namespace) -> int:
    worker_pids = {w["name"]: w["pid"] for w in workers(base)}
    pids = {"server": server_pid, **worker_pids}
    config = dict(concurrency=args.concurrency, max_tokens=args.max_tokens, max_prompt_words=args.max_prompt_words)
    log(f"warm-up {args.warmup_s:.0f}s against {base} (workers {worker_pids})")
    warmup = run_soak(base, SoakConfig(duration_s=args.warmup_s, seed=args.seed, **config))
    idle_before = wait_idle(base, timeout_s=60)
    before = at_idle(pids)
    log(f"soak {args.duration_s:.0f}s, seed {args.seed + 1}")
    t = time.monotonic()
    with ProcessTrace(pids, every_s=args.sample_s) as trace:
        result = run_soak(base, SoakConfig(duration_s=args.duration_s, seed=args.seed + 1, **config))
    load_s = time.monotonic() - t
    idle_after = wait_idle(base, timeout_s=60)
    after = at_idle(pids)
    deadline = time.monotonic() + 15  # a connection the last requests opened may be closing still: one fd, briefly
    while any(after[n][2] > before[n][2] for n in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
        after = at_idle(pids)
    figures = report(result, load_s, trace, before, after)
    now = {w["name"]: w["pid"] for w in workers(base)}
    problems = [*(["not idle after the warm-up"] if idle_before is None else []),
                *([f"not idle after the soak: {stats(base)}"] if idle_after is None else []),
                *([f"workers changed: {worker_pids} -> {now}"] if now != worker_pids else []),
                *([f"{len(warmup.errors) + len(result.errors)} request(s) failed"]
                  if warmup.errors or result.errors else []),
                *(f"{name}: private memory slope {f['private_slope_mb_per_min']:+.3f} MB/min"
                  for name, f in figures.items() if not f["private_slope_mb_per_min"] < args.max_slope_mb_min),
                *(f"{name}: {f['fds_after']} fds at idle after the soak, {f['fds_before']} before"
                  for name, f in figures.items() if f["fds_after"] > f["fds_before"])]
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if args.json:
        counts = {f"{k.value}/{o.value}": n for (k, o), n in sorted(result.counts.items(), key=str)}
        args.json.write_text(json.dumps({
            "serve_args": args.serve_args, "duration_s": load_s, "warmup_s": args.warmup_s, "seed": args.seed,
            "concurrency": args.concurrency, "counts": counts, "statuses": dict(result.statuses),
            "errors": len(warmup.errors) + len(result.errors), "p50_s": result.percentile_s(50),
            "p99_s": result.percentile_s(99), "pending_admission_after": stats(base)["num_pending_admission"],
            "processes": figures, "samples": len(trace.samples), "problems": problems}, indent=1))
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
