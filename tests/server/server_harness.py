"""`kvbaton serve` as a real subprocess, and process helpers, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Children of every thread of `pid` (a worker may be started from a thread other than the main one)."""
    pids: list[int] = []
    for children in sorted(Path(f"/proc/{pid}/task").glob("*/children")):
        try:
            pids += [int(p) for p in children.read_text().split()]
        except FileNotFoundError:  # the thread exited meanwhile
            pass
    return pids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


@contextmanager
def kvbaton_server(*args: str, env: dict | None = None, startup_s: float = 240.0):
    """`kvbaton serve` as a real subprocess on a free loopback port; stopped by PID after."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("server did not become healthy in time")
        yield base, proc
    finally:
        children = child_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in children:  # the engine core must have gone with its frontend
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"engine core {pid} outlived its frontend")
