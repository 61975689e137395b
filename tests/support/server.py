"""`kvbaton serve` as a real subprocess, for the tests that serve (server, doctor, faults, fuzz, soak, the clients).

`served` starts it on a free loopback port, waits for /health and stops it by PID after (its engine core
must go with it). Its output is drained on a thread into a bounded buffer whose tail goes into failure
messages: a pipe nobody reads blocks the server once it fills. `kvbaton_server` is the same server as
(base URL, process).
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


@dataclass(frozen=True)
class Served:
    base: str
    proc: subprocess.Popen
    lines: deque  # the server's output (stdout and stderr), its last 2,000 lines

    def log_tail(self, n: int = 40) -> str:
        return "".join(list(self.lines)[-n:])


def _drain(proc: subprocess.Popen, lines: deque) -> None:
    for line in proc.stdout:
        lines.append(line)


def _healthy(server: Served, drain: threading.Thread) -> bool:
    if server.proc.poll() is not None:
        drain.join(timeout=5)  # the pipe's last lines, written before it exited
        raise RuntimeError(f"server exited early:\n{server.log_tail(200)}")
    try:
        return httpx.get(f"{server.base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def served(*args: str, env: dict | None = None, startup_s: float = 240.0) -> Iterator[Served]:
    """`kvbaton serve` as a real subprocess on a free loopback port, its output drained into a bounded buffer
    (`Served.log_tail`); stopped by PID after. Drained always: a server (or a worker writing to the same pipe)
    that outlogs the 64 KiB pipe nobody reads blocks on its next write, and with it every request it serves."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    server = Served(f"http://127.0.0.1:{port}", proc, deque(maxlen=2000))
    drain = threading.Thread(target=_drain, args=(proc, server.lines), daemon=True)
    drain.start()
    failed = False
    try:
        wait_until(lambda: _healthy(server, drain), startup_s, interval_s=0.2, message="server did not become healthy")
        yield server
    except BaseException:
        failed = True
        raise
    finally:
        children = child_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if failed:  # pytest shows a failing test's captured stderr: the server's side of the story goes with it,
            drain.join(timeout=5)  # to its last line (what its private servers said as they stopped included)
            print(f"---- the server's last lines ----\n{server.log_tail(160)}", file=sys.stderr)
        for pid in children:  # the engine core must have gone with its frontend
            try:
                wait_until(lambda pid=pid: not pid_alive(pid), 10, interval_s=0.2)
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"engine core {pid} outlived its frontend") from None


@contextmanager
def kvbaton_server(*args: str, env: dict | None = None, startup_s: float = 240.0):
    """`served`, as (base URL, process)."""
    with served(*args, env=env, startup_s=startup_s) as server:
        yield server.base, server.proc


def wait_idle(base: str, timeout_s: float = 30.0) -> dict:
    """`/stats` once the server is idle again: nothing running, waiting, in flight or pending admission, no KV
    block held (AssertionError, with the last `/stats`, if not within `timeout_s`)."""
    last: dict = {}

    def idle() -> dict | None:
        nonlocal last
        last = stats(base)
        return last if is_idle(last) else None

    return wait_until(idle, timeout_s, interval_s=0.2, message=lambda: f"server did not return to idle: {last}")


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
