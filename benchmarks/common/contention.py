"""Other load on the machine: waiting for it to go, and recording what overlapped a measurement.

On a shared 2-core machine any other process shows directly in every figure (one busy core made
kvbaton's 2-thread decode ~10x slower), so each measurement waits for quiet first and records
what it saw meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from common.log import log
from common.procs import ancestors, descendants

BUSY = 0.15  # the fraction of all CPUs busy above which the machine is not idle
LOCK_PATH = Path(tempfile.gettempdir()) / "kvbaton-bench.lock"  # benchmarks that take it never overlap


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval` seconds (anyone's processes), from /proc/stat."""

    def sample() -> tuple[int, int]:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(vals), vals[3] + vals[4]  # idle + iowait

    total0, idle0 = sample()
    time.sleep(interval)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_idle(limit_s: float, what: str, notes: list[str]) -> float:
    """Wait up to `limit_s` for other load to go; return the busy fraction seen last (recorded
    with the result), and add a note when the measurement goes ahead on a busy machine."""
    deadline = time.time() + limit_s
    busy = cpu_busy()
    while busy > BUSY and time.time() < deadline:
        log(f"machine {busy:.0%} busy before {what}; waiting for it to go idle")
        time.sleep(5)
        busy = cpu_busy()
    if busy > BUSY:
        log(f"WARNING: machine still {busy:.0%} busy; measuring {what} anyway")
        notes.append(f"machine was {busy:.0%} busy (other processes) just before {what}")
    return busy


class LoadMonitor(threading.Thread):
    """Samples every process's CPU time every `interval` s and adds up what processes outside this
    benchmark (this process, its descendants, and the servers in `roots`) use."""

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.roots = {os.getpid()}
        self.others_s = 0.0
        self._hz = os.sysconf("SC_CLK_TCK")
        self._prev: dict[int, int] | None = None

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, int]]:
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]))  # ppid, utime + stime
        return procs

    def _family(self, cur: dict[int, tuple[int, int]]) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in cur.items():
            children.setdefault(ppid, []).append(pid)
        family: set[int] = set()
        stack = list(self.roots)
        while stack:
            pid = stack.pop()
            if pid not in family:
                family.add(pid)
                stack += children.get(pid, [])
        return family

    def run(self) -> None:
        while True:
            cur = self._snapshot()
            family = self._family(cur)
            if self._prev is not None:
                ticks = sum(t - self._prev.get(pid, 0) for pid, (_, t) in cur.items() if pid not in family)
                self.others_s += max(0, ticks) / self._hz
            self._prev = {pid: t for pid, (_, t) in cur.items()}
            time.sleep(self.interval)

    def window(self) -> LoadWindow:
        return LoadWindow(self)


class LoadWindow:
    """`with monitor.window() as w:` ... then `w.cores`: mean CPU cores used by others meanwhile."""

    def __init__(self, monitor: LoadMonitor) -> None:
        self.monitor, self.cores = monitor, 0.0

    def __enter__(self) -> LoadWindow:
        self.t0, self.s0 = time.perf_counter(), self.monitor.others_s
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(self.monitor.interval * 1.5)  # let the last sample land
        elapsed = time.perf_counter() - self.t0
        self.cores = (self.monitor.others_s - self.s0) / elapsed


def note_load(res: dict, what: str, window: LoadWindow, notes: list[str]) -> None:
    """Record the other load a window saw in `res` (`other_load_cores`), and note it when high."""
    res["other_load_cores"] = round(window.cores, 3)
    if window.cores > 0.1:
        msg = f"other processes used {window.cores:.2f} cores on average during {what}"
        log("WARNING: " + msg)
        notes.append(msg)


def foreign_benchmarks(pattern: str) -> list[str]:
    """Other benchmark processes matching `pattern` (not this one, its children or its parents)."""
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    mine = {os.getpid(), *descendants(os.getpid()), *ancestors(os.getpid())}
    return [ln for ln in out.splitlines() if ln.split() and int(ln.split()[0]) not in mine]


def wait_foreign(pattern: str, limit_s: float, what: str) -> None:
    """Wait while another benchmark runs; give up (RuntimeError) after `limit_s`."""
    deadline = time.time() + limit_s
    while others := foreign_benchmarks(pattern):
        if time.time() > deadline:
            raise RuntimeError(f"another benchmark still running after {limit_s:.0f}s: {others[0]}")
        log(f"waiting for another benchmark to finish before {what}: {others[0][:120]}")
        time.sleep(15)


class OverlapWatch:
    """While a measurement runs, look every few seconds for another benchmark process; what it
    saw (`seen`) is recorded with the result: an overlapping run is not trustworthy."""

    def __init__(self, pattern: str, interval_s: float = 5.0) -> None:
        self.pattern = pattern
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for line in foreign_benchmarks(self.pattern):
                if line[:200] not in self.seen:
                    self.seen.append(line[:200])

    def __enter__(self) -> OverlapWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def take_lock(limit_s: float) -> IO[str]:
    """An exclusive lock on LOCK_PATH for the whole run, so that two benchmarks that both take it
    never measure at the same time; waits up to `limit_s` for it. Held until the file is closed."""
    fh = open(LOCK_PATH, "a+")  # noqa: SIM115 - held until the end of the run
    deadline = time.time() + limit_s
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fh
        except BlockingIOError:
            if time.time() > deadline:
                raise SystemExit(f"{LOCK_PATH} still held after {limit_s:.0f}s") from None
            log(f"waiting for {LOCK_PATH} (another benchmark holds it)")
            time.sleep(15)
