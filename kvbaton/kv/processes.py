"""Helpers for the private servers kvbaton starts beside its workers (a redis-server, a Mooncake Store)."""

from __future__ import annotations

import ctypes
import signal
import socket
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def free_port(host: str) -> int:
    """A port free on `host` now (it can be taken before the caller binds it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """A Popen preexec_fn: the child gets SIGTERM when the thread that started it exits (Linux PR_SET_PDEATHSIG),
    so a crashed `kvbaton serve` leaves no orphan. Runs in the child between fork and exec."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the caller's stop() is then the only way down


def log_tail(log: Path, lines: int = 3) -> str:
    """The last lines of a server's log, one line, for an error message."""
    try:
        return " / ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
