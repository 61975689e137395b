"""An engine's HTTP server on a free loopback port: started, waited for, stopped by PID.

One `Server` serves every engine: `kvbaton serve` (the command is the server: we wait for its
health URL) and the peers (the peers/*.sh scripts start the server in the background, wait for
it themselves and print its PID).
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.log import log
from common.procs import alive, stop_pids

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxies: loopback only
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    name: str
    cmd: list[str]
    port: int
    log_path: Path  # where the server's output goes (a peer script writes it itself)
    env: dict[str, str]
    timeout_s: float  # to be ready
    prints_pid: bool  # True: `cmd` is a launcher that prints the server's PID once it is ready
    health_path: str = "/v1/models"  # polled until 200 when `cmd` is the server itself

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def kvbaton_server(*, name: str, port: int, serve_args: list[str], log_path: Path, env: dict[str, str],
                   timeout_s: float, health_path: str = "/v1/models") -> ServerSpec:
    """`kvbaton serve --port PORT *serve_args` with the interpreter running this script."""
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", str(port), *serve_args]
    return ServerSpec(name=name, cmd=cmd, port=port, log_path=log_path, env=env, timeout_s=timeout_s,
                      prints_pid=False, health_path=health_path)


class Server:
    """`with Server(spec) as server:` (or `start()` ... `stop()` in a `finally`) starts it and,
    whatever happens, stops it by PID with everything it started. A start that fails stops what
    it began and raises RuntimeError with the server's last words."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.pids: list[int] = []
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid(self) -> int | None:
        return self.pids[0] if self.pids else None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Server:
        s = self.spec
        t = time.perf_counter()
        log(f"{s.name}: starting on port {s.port}: {shlex.join(s.cmd)}")
        try:
            if s.prints_pid:
                self._start_launcher()
            else:
                self._start_direct()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t
        log(f"{s.name}: ready in {self.startup_s:.0f}s (pid {self.pid})")
        return self

    def stop(self) -> None:
        if self.pids:
            log(f"{self.spec.name}: stopping pid {self.pid}")
            stop_pids(self.pids)
            self.pids = []

    def _start_launcher(self) -> None:
        s = self.spec
        launcher = subprocess.Popen(s.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=s.env)
        self.pids = [launcher.pid]  # until it says: its background child is the server
        try:
            out, err = launcher.communicate(timeout=s.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{s.name} did not start in {s.timeout_s:.0f}s") from None
        if launcher.returncode != 0 or not out.strip():
            raise RuntimeError(f"{s.name} did not start: {err.strip()[-1500:]}")
        self.pids = [int(out.strip().splitlines()[-1])]

    def _start_direct(self) -> None:
        s = self.spec
        with open(s.log_path, "w") as fh:
            proc = subprocess.Popen(s.cmd, stdout=fh, stderr=subprocess.STDOUT, env=s.env, cwd=ROOT)
        self.pids = [proc.pid]
        deadline = time.time() + s.timeout_s
        while not http_ok(f"{s.base_url}{s.health_path}"):
            if not alive(proc.pid) or time.time() > deadline:
                tail = s.log_path.read_text()[-1500:]
                raise RuntimeError(f"{s.name} did not start (see {s.log_path}): {tail}")
            time.sleep(1)
