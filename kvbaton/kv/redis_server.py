"""A private, throw-away `redis-server` for the redis KV transport.

`kvbaton serve --kv-transport redis` without `--redis-url` starts one of these (and tests do):
bound to loopback only, no persistence (`save ''`, `appendonly no`: KV blocks are transient
and must not reach a disk), a free port, and a random `requirepass`. The config travels on
the server's stdin (`redis-server -`), so the password never shows in `ps`; the returned URL
carries it, so hand the URL to workers the way the cluster secret goes (environment, not argv).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvbaton.kv.owner import REDIS_PREFIX, owned_temp_dir
from kvbaton.kv.processes import die_with_parent as term_with_parent
from kvbaton.kv.processes import free_port, log_tail

logger = logging.getLogger(__name__)

_CHILDREN: dict[int, subprocess.Popen] = {}  # pid -> handle, so stop() can reap what start() spawned
_MAXMEMORY_POLICIES = ("noeviction", "allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu",
                       "volatile-random", "volatile-ttl")


class RedisServerError(RuntimeError):
    """redis-server is missing, or did not come up."""


@dataclass(frozen=True)
class RedisServer:
    pid: int
    host: str
    port: int
    url: str  # redis://:<password>@host:port/0 — a secret: keep it out of argv and logs
    workdir: str  # its `dir` and log file; removed by stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_redis_server(self.pid, timeout_s)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def start_redis_server(host: str = "127.0.0.1", maxmemory_mb: int | None = None, startup_timeout_s: float = 10.0,
                       die_with_parent: bool = True, maxmemory_policy: str = "noeviction") -> RedisServer:
    """Start redis-server on a free port and wait until it answers an authenticated PING.

    `maxmemory_policy` applies with `maxmemory_mb`: the default refuses writes when full (a KV
    transfer must not lose a layer); a KV store's cache can run "allkeys-lru" instead.

    `die_with_parent`: the server gets SIGTERM when the thread that started it exits (Linux
    PR_SET_PDEATHSIG), so a crashed `kvbaton serve` leaves no orphan — start it from the main
    thread, or pass False and own its lifetime.
    """
    binary = redis_server_binary()
    if binary is None:
        raise RedisServerError("redis-server is not installed (scripts/setup.sh installs it: apt-get install "
                               "redis-server), or pass --redis-url of a running server")
    if maxmemory_policy not in _MAXMEMORY_POLICIES:
        raise ValueError(f"maxmemory_policy {maxmemory_policy!r} is not one of {', '.join(_MAXMEMORY_POLICIES)}")
    errors = []
    for _ in range(3):  # NOTE: the free port can be taken between probe and bind; then try another
        try:
            return _start_once(binary, host, free_port(host), maxmemory_mb, startup_timeout_s, die_with_parent,
                               maxmemory_policy)
        except RedisServerError as exc:
            errors.append(str(exc))
    raise RedisServerError("redis-server did not start: " + " | ".join(errors))


def stop_redis_server(pid: int, timeout_s: float = 5.0) -> None:
    """SIGTERM the server with this PID, SIGKILL it after `timeout_s`, and reap it."""
    proc = _CHILDREN.pop(pid, None)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if proc is not None:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
        return
    deadline = time.monotonic() + timeout_s  # not our child: all we can do is watch the PID
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def _start_once(binary: str, host: str, port: int, maxmemory_mb: int | None, startup_timeout_s: float,
                die_with_parent: bool, maxmemory_policy: str = "noeviction") -> RedisServer:
    password = secrets.token_hex(24)
    workdir = str(owned_temp_dir(REDIS_PREFIX))  # its owner recorded: the janitor removes it if we are killed
    log = Path(workdir, "redis.log")
    lines = [f"bind {host}", f"port {port}", "protected-mode yes", "save ''", "appendonly no", f"dir {workdir}",
             f"logfile {log}", "daemonize no", f"requirepass {password}"]
    if maxmemory_mb:
        lines += [f"maxmemory {maxmemory_mb}mb", f"maxmemory-policy {maxmemory_policy}"]  # default: never drop KV
    proc = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=term_with_parent if die_with_parent else None)
    assert proc.stdin is not None  # stdin=PIPE
    proc.stdin.write(("\n".join(lines) + "\n").encode())
    proc.stdin.close()
    _CHILDREN[proc.pid] = proc
    url = f"redis://:{password}@{host}:{port}/0"
    try:
        _wait_ready(proc, url, log, startup_timeout_s)
    except RedisServerError:
        stop_redis_server(proc.pid)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    logger.info("redis-server pid %d listening on %s:%d", proc.pid, host, port)
    return RedisServer(proc.pid, host, port, url, workdir)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RedisServerError(f"exited with code {proc.returncode}: {log_tail(log)}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RedisServerError(f"no answer within {timeout_s:.0f} s: {log_tail(log)}")
    finally:
        client.close()
