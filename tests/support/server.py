"""`kvbaton serve` as a real subprocess, for the tests that serve (server, doctor, faults, fuzz, soak, the clients).

`kvbaton_server` starts it on a free loopback port, waits for /health and stops it by PID after (its
engine core must go with it). `served` is the same server with its output drained on a thread: the
harness gives the server a stdout pipe that nobody reads while it runs, and under fuzzing or a long soak
the server and its workers may log enough to fill the pipe and block on a write; the drained lines
are kept in a bounded buffer whose tail goes into failure messages.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from kvbaton.bench.soak import is_idle, stats
from tests.support.procs import child_pids, pid_alive
from tests.support.wait import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(proc: subprocess.Popen, base: str) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def kvbaton_server(*args: str, env: dict | None = None, startup_s: float = 240.0):
    """`kvbaton serve` as a real subprocess on a free loopback port; stopped by PID after."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(proc, base), startup_s, interval_s=0.2, message="server did not become healthy")
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
            try:
                wait_until(lambda pid=pid: not pid_alive(pid), 10, interval_s=0.2)
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"engine core {pid} outlived its frontend") from None


def wait_idle(base: str, timeout_s: float = 30.0) -> dict:
    """`/stats` once the server is idle again: nothing running, waiting, in flight or pending admission, no KV
    block held (AssertionError, with the last `/stats`, if not within `timeout_s`)."""
    last: dict = {}

    def idle() -> dict | None:
        nonlocal last
        last = stats(base)
        return last if is_idle(last) else None

    return wait_until(idle, timeout_s, interval_s=0.2, message=lambda: f"server did not return to idle: {last}")


@dataclass(frozen=True)
class Served:
    base: str
    proc: subprocess.Popen
    lines: deque

    def log_tail(self, n: int = 40) -> str:
        return "".join(list(self.lines)[-n:])


def _drain(proc: subprocess.Popen, lines: deque) -> None:
    for line in proc.stdout:
        lines.append(line)


@contextmanager
def served(*args: str) -> Iterator[Served]:
    """`kvbaton_server` with its output drained into a bounded buffer (`Served.log_tail`)."""
    with kvbaton_server(*args) as (base, proc):
        lines: deque = deque(maxlen=2000)
        threading.Thread(target=_drain, args=(proc, lines), daemon=True).start()
        yield Served(base, proc, lines)


async def stream_completion(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed /v1/completions request (`body` must ask for the usage chunk): its status, completion tokens,
    finish reason, error chunks and the arrival time of each token chunk."""
    times, finish, errors, tokens = [], None, [], None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "error": (await resp.aread()).decode()[:300]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            elif chunk["choices"]:
                times.append(time.monotonic())
                finish = chunk["choices"][0]["finish_reason"] or finish
            else:  # the usage chunk
                tokens = chunk["usage"]["completion_tokens"]
    return {"status": 200, "tokens": tokens, "finish": finish, "errors": errors, "times": times}
