"""Workers as local processes (the embedded default): start by spec, watch, stop by PID."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvbaton.disagg.spec import SPEC_ENV, WorkerSpec
from kvbaton.wire import SECRET_ENV

logger = logging.getLogger(__name__)


@dataclass
class LocalWorker:
    spec: WorkerSpec
    proc: subprocess.Popen


class LocalLauncher:
    """One `python -m kvbaton.disagg.worker` process per worker, titled `kvbaton-<role>-<index>`.

    The cluster secret and the spec (which may hold a Redis password) go through the
    environment, never the command line (`ps` shows argv to everyone)."""

    backend = "local"

    def __init__(self, secret: bytes, log_dir: Path | None = None) -> None:
        self._secret = secret
        self.log_dir = log_dir  # None: workers log to this process's stderr
        self.workers: dict[str, LocalWorker] = {}

    def launch(self, spec: WorkerSpec) -> None:
        cmd = [sys.executable, "-m", "kvbaton.disagg.worker", "--exit-with-parent"]
        env = {**os.environ, SECRET_ENV: self._secret.decode(), SPEC_ENV: msgspec.json.encode(spec).decode(),
               "TOKENIZERS_PARALLELISM": "false"}
        threads = spec.engine.num_threads
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{spec.name}.log", "ab")  # noqa: SIM115 - the child keeps it open
        self.workers[spec.name] = LocalWorker(spec, subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        if log is not None:
            log.close()
        logger.info("started %s (pid %d)", spec.name, self.workers[spec.name].proc.pid)

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
