"""Temp dirs that name their owner, so a later `kvbaton serve` can tell a leftover from one in use.

A private server's temp dir (`kvbaton-redis-*`, `kvbaton-mooncake-*`, `kvbray-*`) holds an `owner`
file: the PID of the process that made it (whose `stop` removes it) and that process's start time,
which tells the owner from a later process that reuses its PID. `kvbaton.cluster.janitor` removes
the dirs whose owner is gone; a dir without a readable owner file is never taken for a leftover.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

OWNER_FILE = "owner"
REDIS_PREFIX = "kvbaton-redis-"
MOONCAKE_PREFIX = "kvbaton-mooncake-"
RAY_PREFIX = "kvbray-"  # NOTE: short: Ray's unix socket paths live in its temp dir (108-byte limit)
PREFIXES = (REDIS_PREFIX, MOONCAKE_PREFIX, RAY_PREFIX)


class Owner(NamedTuple):
    pid: int
    start_ticks: int  # /proc/<pid>/stat's starttime: the same PID later is another process


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and ')'
    return None if fields[0] in ("Z", "X") else int(fields[19])  # fields 3 and 22 of proc(5)


def this_process() -> Owner:
    ticks = start_ticks(os.getpid())
    assert ticks is not None  # we are running
    return Owner(os.getpid(), ticks)


def is_alive(owner: Owner) -> bool:
    return start_ticks(owner.pid) == owner.start_ticks


def owned_temp_dir(prefix: str, directory: str | None = None) -> Path:
    """`tempfile.mkdtemp` (0700), with this process recorded as its owner."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    write_owner(path, this_process())
    return path


def write_owner(directory: Path, owner: Owner) -> None:
    fd = os.open(directory / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{owner.pid} {owner.start_ticks}\n")


def read_owner(directory: Path) -> Owner | None:
    """The owner recorded in `directory`, or None where there is no well-formed record (never a symlink's)."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        fields = f.read(64).split() if stat.S_ISREG(os.fstat(fd).st_mode) else []
    if len(fields) != 2 or not all(x.isdigit() for x in fields):
        return None
    return Owner(int(fields[0]), int(fields[1]))
