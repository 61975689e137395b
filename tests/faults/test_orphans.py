"""Nothing outlives a killed `kvbaton serve`: SIGKILL (which no handler sees) during the workers' model load
or once they serve, colocated and 1P+1D over a private redis-server, and every process it started exits by
itself. Before, a worker read its launcher's PID only once its model was loaded: killed during the load,
`serve` left a worker holding its model and KV pool for good. The same for a private Ray head (its guard ends
its session and removes its temp dir), and what only a `finally` would have removed (a private server's temp
dir) goes when the next `serve` starts (the janitor, `tests/faults/test_janitor.py`)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from kvbaton.cluster import janitor
from kvbaton.kv.owner import PREFIXES, REDIS_PREFIX, read_owner
from tests.support.procs import child_pids, pid_alive, repo_python_env
from tests.support.server import free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=repo_python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(base: str) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 240, interval_s=0.2, message="serve did not become healthy")


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
def test_a_killed_colocated_serve_leaves_no_worker_and_no_arena(default_model_dir, when):
    """With an shm KV store: the arena serve named for itself goes too (its worker removes it as it exits)."""
    proc, base = _serve("--dtype", "float32", "--max-model-len", "1024", "--kv-store", "shm")
    if when == "while serving":
        _wait_healthy(base)
        assert glob.glob(f"/dev/shm/kvb-store-serve-{proc.pid}-*"), "the worker made no arena"
    _kill_and_expect_no_orphans(proc, expected_children=1)
    wait_until(lambda: not glob.glob(f"/dev/shm/kvb-store-serve-{proc.pid}-*"), 30, interval_s=0.2,
               message="the killed serve's shm arena stayed")


def test_a_killed_pd_serve_over_redis_leaves_no_process(tiny_llama):
    """1P+1D with its private redis-server: two workers and redis, all killed with `serve` mid-load; the
    redis-server's temp dir, which only a `finally` would have removed, goes at the next start-up (the janitor)."""
    proc, _ = _serve("--model", str(tiny_llama), "--dtype", "float32", "--prefill", "1", "--decode", "1",
                     "--kv-transport", "redis", "--local-prefill-threshold", "0", "--block-size", "4")
    _kill_and_expect_no_orphans(proc, expected_children=3)
    left = _temp_dirs_of(proc.pid)
    assert [p.name[:len(REDIS_PREFIX)] for p in left] == [REDIS_PREFIX]
    janitor.sweep()  # NOTE: or another test's `serve` swept it first (each start-up sweeps): gone either way
    assert not left[0].exists()


def _temp_dirs_of(pid: int) -> list[Path]:
    """The private servers' temp dirs that process `pid` made (see `kvbaton.kv.owner`)."""
    return [p for prefix in PREFIXES for p in Path(tempfile.gettempdir()).glob(f"{prefix}*")
            if (owner := read_owner(p)) is not None and owner.pid == pid]


# ---- the private Ray head ----------------------------------------------------------------------

# a launcher of the private Ray head, as the Ray backend starts it: prints its temp dir, then waits to be killed
_HEAD_PARENT = """
import sys
from kvbaton.cluster.ray.head import LocalHead
head = LocalHead(num_cpus=1, object_store_bytes=100 * 2**20)
print(head.temp_dir, flush=True)
head.start(timeout_s=120)
print("up", flush=True)
sys.stdin.read()
"""


def _kill_all(launcher: subprocess.Popen, session: int) -> None:
    """Whatever a failed test left: the launcher and the live processes of the head's session (-1: none yet)."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    for pid in _session(session) if session > 0 else []:
        os.kill(pid, signal.SIGKILL)


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (the guard leads the head's)."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid and pid_alive(int(entry.name)):
                pids.append(int(entry.name))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return pids


def test_a_launcher_killed_while_its_private_ray_head_starts_takes_it_along():
    """SIGKILL the process that started a private Ray head while Ray starts: the head's whole session (the guard,
    `ray start`, gcs_server, raylet, ...) exits and its temp dir goes. (Once it is up: the Ray serve test below.)"""
    parent = subprocess.Popen([sys.executable, "-c", _HEAD_PARENT], env=repo_python_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    temp_dir, session = parent.stdout.readline().strip(), -1
    try:
        [session] = wait_until(lambda: child_pids(parent.pid), 30, message="the guard did not start")
        wait_until(lambda: child_pids(session), 30, message="the guard did not start `ray start`")
        assert len(_session(session)) >= 2 and os.path.isdir(temp_dir)
        parent.kill()
        parent.wait()
        wait_until(lambda: not _session(session) and not os.path.exists(temp_dir), 60, interval_s=0.2,
                   message=lambda: f"left: session {_session(session)}, temp dir {os.path.exists(temp_dir)}")
    finally:
        _kill_all(parent, session)


def test_a_killed_ray_serve_leaves_no_process(tiny_llama):
    """`--backend ray` with its private head, 1P+1D, SIGKILLed once it serves: the head's session (the guard, raylet,
    gcs_server, the worker actors) and both workers exit, and the head's temp dir goes."""
    proc, base = _serve("--backend", "ray", "--model", str(tiny_llama), "--dtype", "float32", "--prefill", "1",
                        "--decode", "1", "--block-size", "4", "--threads", "1")
    session = -1
    try:
        _wait_healthy(base)
        workers = [w["pid"] for w in httpx.get(f"{base}/workers", timeout=10).json()["workers"]]
        guards = [p for p in child_pids(proc.pid)
                  if b"kvbaton.cluster.guard" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2 and len(guards) == 1, (workers, guards)
        session = guards[0]  # it leads the head's session
        args = Path(f"/proc/{session}/cmdline").read_bytes().split(b"\0")
        temp_dir = args[args.index(b"--remove") + 1].decode()
        assert len(_session(session)) >= 3 and os.path.isdir(temp_dir)
        proc.kill()
        proc.wait()
        wait_until(lambda: not _session(session) and not any(map(pid_alive, workers)) and not os.path.exists(temp_dir),
                   60, interval_s=0.2, message=lambda: f"left: session {_session(session)}, workers "
                   f"{[p for p in workers if pid_alive(p)]}, temp dir {os.path.exists(temp_dir)}")
    finally:
        _kill_all(proc, session)
