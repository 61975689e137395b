"""A private single-machine Ray head, started and stopped by PID (never `ray stop`), with token auth.

It dies with the process that started it, from its first moment: `ray start` runs under a guard
(`kvbaton.cluster.guard`) that ends the head's session and removes its temp dir once that process is
gone, however it went (SIGKILL included)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

from kvbaton.cluster.guard import guard_command
from kvbaton.cluster.ray.auth import head_env, write_token
from kvbaton.cluster.ray.loopback import SINGLE_MACHINE_ENV
from kvbaton.kv.owner import RAY_PREFIX, owned_temp_dir

logger = logging.getLogger(__name__)


class LocalHead:
    """`ray start --head --block` under a guard (`proc`, our child) in its own session: one machine, 127.0.0.1 only.

    Token authentication is on, with a fresh token in `token_path` (0600, see `auth`), which goes
    with the temp dir at `stop`; a client needs RAY_AUTH_MODE=token and that token to join."""

    def __init__(self, num_cpus: int, object_store_bytes: int) -> None:
        self.num_cpus, self.object_store_bytes = int(num_cpus), object_store_bytes
        # NOTE: short and under /tmp: Ray's unix socket paths live in here (108-byte limit).
        self.temp_dir = owned_temp_dir(RAY_PREFIX, "/tmp")
        self.log_path = self.temp_dir / "head.log"
        self.token_path = self.temp_dir / "auth_token"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> str:
        """Start it and return its GCS address, which `ray start` writes once the node is up."""
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port=0",
               f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={self.num_cpus}", "--num-gpus=0", f"--object-store-memory={self.object_store_bytes}"]
        env = {**head_env(write_token(self.token_path)), SINGLE_MACHINE_ENV: "0", "RAY_USAGE_STATS_ENABLED": "0"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(guard_command(os.getpid(), self.temp_dir, cmd), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        marker, deadline = self.temp_dir / "ray_current_cluster", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Ray head exited ({self.proc.returncode}):\n{self._log_tail()}")
            address = marker.read_text().strip() if marker.exists() else ""
            if address:
                logger.info("private Ray head (pid %d) at %s, temp dir %s", self.proc.pid, address, self.temp_dir)
                return address
            time.sleep(0.1)
        raise RuntimeError(f"the Ray head did not start within {timeout_s:g} s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM: the guard has `ray start --block` stop what it started; then SIGKILL its process group."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("the Ray head (pid %d) ignored SIGTERM; killing its group", self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of its session, if any
            except ProcessLookupError:
                pass
            self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
