"""`kvbaton serve` as a real subprocess, and process helpers, for the tests that serve (server, doctor)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx
from helpers import child_pids, pid_alive  # noqa: F401  (re-exported for the server tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def kvbaton_server(*args: str, env: dict | None = None, startup_s: float = 240.0):
    """`kvbaton serve` as a real subprocess on a free loopback port; stopped by PID after. Its output goes to a
    file, not a pipe nobody reads: a server that logs a lot (probes, many requests) never blocks on a full pipe."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited early:\n{log.read()[-5000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            log.seek(0)
            raise RuntimeError(f"server did not become healthy in {startup_s:.0f} s:\n{log.read()[-5000:]}")
        yield base, proc
    finally:
        children = child_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for pid in children:  # the engine core must have gone with its frontend
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"engine core {pid} outlived its frontend")
