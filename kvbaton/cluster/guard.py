"""A process of its own between a launcher and a private server: the server dies with the launcher.

    kvbaton serve ── python -m kvbaton.cluster.guard (session leader) ── `ray start --head --block` ── raylet, ...

The guard runs the command as its child, in its own session, and compares its parent with the launcher's
PID (given on its command line), as `kvbaton.worker.lifeline` does for a worker. Once the launcher is
gone (a SIGKILL, which no handler sees, included) it ends the session: SIGTERM to the command, SIGKILL
to whatever of the session is left after a grace period, then removes the command's temp dir. From the
launcher's side it stands for the command: it exits with the command, and SIGTERM stops the command
the same way (without removing anything: the launcher reads the log and removes the dir itself).
`PR_SET_PDEATHSIG` would not do: it fires when the *thread* that forked the child exits.

Light on purpose (stdlib only): it runs before the command starts, and delays it by its import time.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("kvbaton.cluster.guard")  # NOTE: not __name__: it is "__main__" under `python -m`

CHECK_EVERY_S = 0.2
GRACE_S = 10.0  # after SIGTERM, what is left of the session is killed
KILL_WAIT_S = 5.0


def guard_command(parent_pid: int, remove: Path, command: list[str]) -> list[str]:
    """The command line that runs `command` under a guard for `parent_pid` (start it in a new session)."""
    return [sys.executable, "-m", "kvbaton.cluster.guard", "--parent", str(parent_pid), "--remove", str(remove),
            "--", *command]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if os.getsid(0) != os.getpid():
        os.setsid()  # NOTE: the session is what we end: never the caller's
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    child = subprocess.Popen(args.command, stdin=subprocess.DEVNULL) if os.getppid() == args.parent else None
    while child is not None and child.poll() is None and not stopping and os.getppid() == args.parent:
        time.sleep(CHECK_EVERY_S)
    orphaned = os.getppid() != args.parent
    if orphaned:
        logger.warning("the launcher (pid %d) is gone: stopping %s", args.parent, " ".join(args.command[:3]))
    code = end_session(child, args.grace)
    if orphaned:
        shutil.rmtree(args.remove, ignore_errors=True)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.cluster.guard")
    parser.add_argument("--parent", type=int, required=True, help="the launcher's PID")
    parser.add_argument("--remove", type=Path, required=True, help="the command's temp dir, removed once it is down")
    parser.add_argument("--grace", type=float, default=GRACE_S)
    parser.add_argument("command", nargs="+")
    return parser


def end_session(child: subprocess.Popen | None, grace_s: float) -> int:
    """SIGTERM the command (`ray start --block` then stops what it started) and wait for it, at most `grace_s`;
    then SIGKILL what is left of our session, and return once it is gone: the command's exit code."""
    if child is not None and child.poll() is None:
        child.terminate()
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored SIGTERM for %g s: killing the session", child.pid, grace_s)
    deadline = time.monotonic() + KILL_WAIT_S
    while (left := session_pids()) and time.monotonic() < deadline:
        for pid in left:
            _kill(pid)
        time.sleep(0.01)  # SIGKILL takes effect asynchronously
    code = None if child is None else child.poll()
    return 1 if code is None else code


def session_pids() -> list[int]:
    """The live processes of our session but us (zombies are not alive)."""
    sid, me, pids = os.getsid(0), os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != me and _in_session(int(entry.name), sid):
            pids.append(int(entry.name))
    return pids


def _in_session(pid: int, sid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] not in ("Z", "X") and int(fields[3]) == sid  # fields 3 (state) and 6 (session) of proc(5)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone; or not ours to kill (a setuid helper): left as it is
        pass


if __name__ == "__main__":
    sys.exit(main())
