"""Workers as local processes (the embedded default): start by spec, watch, stop by PID."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbaton.cluster.worker_env import worker_env
from kvbaton.messages.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass
class LocalWorker:
    spec: WorkerSpec
    proc: subprocess.Popen


class LocalLauncher:
    """One `python -m kvbaton.worker.main` process per worker, titled `kvbaton-<role>-<index>`.

    Implements `kvbaton.router.launcher.Launcher`. The cluster secret and the spec reach the
    worker through its environment (`worker_env`), never its command line."""

    backend = "local"

    def __init__(self, secret: bytes, log_dir: Path | None = None) -> None:
        self._secret = secret
        self.log_dir = log_dir  # None: workers log to this process's stderr
        self.workers: dict[str, LocalWorker] = {}

    def start(self) -> str:
        """Nothing to bring up: every worker runs on this machine, so the router listens on loopback."""
        return LOOPBACK

    def launch(self, spec: WorkerSpec) -> None:
        if self.is_alive(spec.name):
            raise ValueError(f"{spec.name} is running already")
        cmd = [sys.executable, "-m", "kvbaton.worker.main", "--exit-with-parent"]
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{spec.name}.log", "ab")  # noqa: SIM115 - the child keeps it open
        proc = subprocess.Popen(cmd, env=worker_env(spec, self._secret), stdout=log, stderr=log)
        self.workers[spec.name] = LocalWorker(spec, proc)
        if log is not None:
            log.close()
        logger.info("started %s (pid %d)", spec.name, proc.pid)

    def launch_group(self, specs: list[WorkerSpec]) -> None:
        """Local processes need no placement: each rank is started in turn (none waits for the others here)."""
        try:
            for spec in specs:
                self.launch(spec)
        except BaseException:
            for spec in specs:
                self.kill(spec.name)
            raise

    def launch_gang(self, specs: list[WorkerSpec], joining: list[str]) -> None:
        """Local processes need no placement: the workers that join later are started by `launch`."""
        self.launch_group(specs)

    def is_alive(self, name: str) -> bool:
        worker = self.workers.get(name)
        return worker is not None and worker.proc.poll() is None

    def pid(self, name: str) -> int | None:
        worker = self.workers.get(name)
        return worker.proc.pid if worker else None

    def kill(self, name: str) -> None:
        """SIGKILL (by PID) a worker declared dead, so a stalled one cannot come back."""
        worker = self.workers.pop(name, None)
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        """Wait for a worker told to shut down; kill it (by PID) if it does not exit in time."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return
        try:
            worker.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()

    def stop_all(self, timeout_s: float = 10.0) -> None:
        for name in list(self.workers):
            self.stop(name, timeout_s)

    def close(self) -> None:
        """Kill every worker still running (those told to shut down have had `stop_all` already)."""
        self.stop_all(timeout_s=0)
