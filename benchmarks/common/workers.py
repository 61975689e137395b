"""One engine per process: the script runs itself again with a hidden `--_worker` flag, the
worker prints one tagged JSON line, and the parent parses it, under a time limit.

Why a process each: every engine then starts from a cold, clean interpreter (no allocator or
thread-pool state left by the previous one), and a hung engine costs a time-out, not the run.
"""

from __future__ import annotations

import json
import subprocess
import traceback
from collections.abc import Callable
from typing import Any

from common.records import to_json

RESULT_TAG = "BENCH_RESULT:"


def worker_main(fn: Callable[[], Any]) -> None:
    """In the worker: run `fn` and print its result (a record or a dict) as the tagged line.
    A failure is reported, not raised: the parent records it and goes on with the next engine."""
    try:
        res = to_json(fn())
    except Exception as exc:
        traceback.print_exc()
        res = {"error": f"{type(exc).__name__}: {exc}"}
    print(RESULT_TAG + json.dumps(res), flush=True)


class WorkerFailed(RuntimeError):
    """The worker process timed out, crashed, or printed no result."""


def run_worker(cmd: list[str], env: dict[str, str], timeout_s: float, what: str = "worker") -> dict:
    """In the parent: run a worker command and return its result (which may itself be an
    `{"error": ...}` the worker caught); its stderr goes to ours, so a traceback shows."""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise WorkerFailed(f"{what} timed out after {timeout_s:.0f}s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise WorkerFailed(f"{what} exited {proc.returncode}: {proc.stdout[-2000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])
