"""`kvbaton serve` for the fuzz, soak, autoscale and doctor tests: the harness's server, with its output drained.

NOTE: the harness gives the server a stdout pipe that nobody reads while it runs; under fuzzing
or a long soak the server and its workers may log enough to fill the pipe and block on a write.
A thread reads it into a bounded buffer, whose tail goes into failure messages.
"""

from __future__ import annotations

import subprocess
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
