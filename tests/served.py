"""`kvbaton serve` for the fuzz, soak, autoscale and doctor tests: the harness's server, with its output drained.

NOTE: the harness gives the server a stdout pipe that nobody reads while it runs; under fuzzing
or a long soak the server and its workers may log enough to fill the pipe and block on a write.
A thread reads it into a bounded buffer, whose tail goes into failure messages.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from server_harness import kvbaton_server


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
