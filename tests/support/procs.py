"""Processes: the environment of a Python child that imports the tests package, and checks on PIDs.

Light on purpose (no torch): helper scripts and `python -c` children import it.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m tests.<...>` finds the tests package


def repo_python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a Python child that imports the tests package (a helper script run with
    `python -m tests.<...>`, a `python -c` snippet): this one, the repository root first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


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
    """`pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


def listening_addresses(pid: int) -> dict[str, str]:
    """port -> address of every TCP socket `pid` listens on, as the kernel has it (`ss`), not as a flag says."""
    import subprocess

    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    local = [line.split()[3] for line in lines if f"pid={pid}," in line]
    return {address.rsplit(":", 1)[1]: address.rsplit(":", 1)[0] for address in local}
