"""Nothing outlives a killed `kvbaton serve`: SIGKILL (which no handler sees) during the workers' model load
or once they serve, colocated and 1P+1D over a private redis-server, and every process it started exits by
itself. Before, a worker read its launcher's PID only once its model was loaded: killed during the load,
`serve` left a worker holding its model and KV pool for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.support.procs import child_pids, pid_alive, repo_python_env
from tests.support.server import free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=repo_python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _kill_and_expect_no_orphans(proc: subprocess.Popen, expected_children: int) -> None:
    started: set[int] = set()

    def all_started() -> bool:
        started.update(child_pids(proc.pid))
        return len(started) >= expected_children

    try:
        wait_until(all_started, 120, interval_s=0.05, message=lambda: f"serve started {sorted(started)} only")
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(pid_alive(p) for p in started), 30, interval_s=0.2,
                   message=lambda: f"outlived the killed serve: {[p for p in started if pid_alive(p)]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["during the load", "while serving"])
def test_a_killed_colocated_serve_leaves_no_worker(default_model_dir, when):
    proc, base = _serve("--dtype", "float32", "--max-model-len", "1024")
    if when == "while serving":
        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 240, interval_s=0.2, message="serve did not become healthy")
    _kill_and_expect_no_orphans(proc, expected_children=1)


def test_a_killed_pd_serve_over_redis_leaves_no_process(tiny_llama):
    """1P+1D with its private redis-server: two workers and redis, all killed with `serve` mid-load."""
    proc, _ = _serve("--model", str(tiny_llama), "--dtype", "float32", "--prefill", "1", "--decode", "1",
                     "--kv-transport", "redis", "--local-prefill-threshold", "0", "--block-size", "4")
    _kill_and_expect_no_orphans(proc, expected_children=3)
