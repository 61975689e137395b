"""Processes by PID: the environment a measured process gets, its family, and stopping it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from common.log import log

_PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


def thread_env(threads: int) -> dict[str, str]:
    """This environment, with every thread pool at `threads` and no proxy: all traffic of a
    benchmark stays on 127.0.0.1."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    for key in _PROXY_VARS:
        env.pop(key, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in descendants(k)]


def ancestors(pid: int) -> list[int]:
    """The processes above `pid` (the shells and wrappers that started this script)."""
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            break
        out.append(pid)
    return out


def alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_pids(pids: list[int]) -> None:
    """SIGTERM these processes and, if they outlive it, the processes they started; by PID.

    NOTE: the family is listed before the first signal: once a server exits, its workers are
    re-parented and could no longer be found under it."""
    family = list(dict.fromkeys(p for pid in pids for p in [pid, *descendants(pid)]))
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        for p in family:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and any(alive(p) for p in family):
            time.sleep(0.5)
        if not any(alive(p) for p in family):
            return
    log(f"WARNING: processes still alive after SIGKILL: {[p for p in family if alive(p)]}")


def run_job_child(script: str, job: dict, env: dict[str, str], timeout_s: float, what: str) -> dict:
    """Run `script --run JOB` (one measured job, in a fresh process) and return the JSON its last stdout line
    holds; RuntimeError with its stderr's tail if it fails."""
    import json
    import sys

    proc = subprocess.run([sys.executable, script, "--run", json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
