"""When a stage of a serving run may go: after any other benchmark and other load, and only
while enough of the time budget (--budget-min, not counting those waits) is left."""

from __future__ import annotations

import argparse
import math
import time

from common.contention import wait_foreign, wait_idle
from common.log import log

# Other benchmarks that must not overlap a measurement on this (2-core) machine.
FOREIGN_BENCH_PATTERN = r"benchmarks/bench_(engine|serve)\.py"


def budget_left(args: argparse.Namespace) -> float:
    """Seconds left of --budget-min, not counting time spent waiting for the machine."""
    if args.budget_min is None:
        return math.inf
    return args.budget_min * 60 - (time.perf_counter() - args.t_start - args.waited_s)


def over_budget(args: argparse.Namespace, what: str, need_s: float = 60.0) -> dict | None:
    left = budget_left(args)
    if left < need_s:
        msg = f"skipped: {left / 60:.1f} min left of --budget-min {args.budget_min:g}"
        log(f"{what}: {msg}")
        return {"skipped": msg}
    return None


def run_cap(args: argparse.Namespace) -> int:
    return int(max(30, min(args.sizes.run_cap_s, budget_left(args))))


def wait_turn(args: argparse.Namespace, what: str) -> float:
    """Before each measurement: wait while another benchmark runs (up to --wait-foreign s, then
    give up), then up to --wait-idle s for other CPU load to go. Returns the busy fraction seen."""
    t0 = time.perf_counter()
    try:
        wait_foreign(FOREIGN_BENCH_PATTERN, args.wait_foreign, what)
        return wait_idle(args.wait_idle, what, args.notes)
    finally:
        args.waited_s += time.perf_counter() - t0
