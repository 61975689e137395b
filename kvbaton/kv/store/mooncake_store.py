"""A private Mooncake Store for the KV store's mooncake tier: `mooncake_master` (with its HTTP metadata server)
and one `mooncake_client` process that holds the store's memory, all on loopback and free ports.

Why a client process of its own: a Mooncake Store keeps objects in the memory that its clients mount, so
blocks held in a worker's own segment would vanish with the worker. The workers mount none; the store
process owns the capacity, the way a private redis-server does for the redis tier. Both processes get
SIGTERM if the thread that started them exits (Linux PR_SET_PDEATHSIG), and `stop()` ends them by PID.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvbaton.kv.owner import MOONCAKE_PREFIX, owned_temp_dir
from kvbaton.kv.processes import die_with_parent, free_port, log_tail

logger = logging.getLogger(__name__)


class MooncakeStoreError(RuntimeError):
    """The Mooncake binaries are missing, or the store did not come up."""


@dataclass(frozen=True)
class MooncakeStore:
    master: str  # host:port of the master's RPC
    metadata_url: str  # the master's HTTP metadata server
    pids: tuple[int, ...]
    workdir: str  # the processes' logs; removed by stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        for pid in reversed(self.pids):
            _stop(pid, timeout_s)
        for name in ("master.log", "client.log"):  # their warnings and errors outlive the workdir: in our log
            problems = _glog_problems(Path(self.workdir, name))
            if problems:
                logger.info("mooncake store %s, its last warnings and errors:\n%s", name, "\n".join(problems))
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mooncake_binary(name: str) -> str | None:
    """A Mooncake executable: beside this interpreter (the wheel's entry points), else on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def start_mooncake_store(capacity_bytes: int, host: str = "127.0.0.1",
                         startup_timeout_s: float = 30.0) -> MooncakeStore:
    master_bin, client_bin = mooncake_binary("mooncake_master"), mooncake_binary("mooncake_client")
    if master_bin is None or client_bin is None:
        raise MooncakeStoreError("the Mooncake Store binaries (mooncake_master, mooncake_client) are not installed: "
                                 "they come with the mooncake-transfer-engine wheel")
    workdir = str(owned_temp_dir(MOONCAKE_PREFIX))  # its owner recorded: the janitor removes it if we are killed
    rpc, http, metrics, client_port = (free_port(host) for _ in range(4))
    master, metadata_url = f"{host}:{rpc}", f"http://{host}:{http}/metadata"
    pids: list[int] = []
    try:
        pids.append(_spawn([master_bin, f"-rpc_port={rpc}", f"-rpc_address={host}", f"-metrics_port={metrics}",
                            "-enable_http_metadata_server=true", f"-http_metadata_server_host={host}",
                            f"-http_metadata_server_port={http}", "-enable_metric_reporting=false",
                            f"-metrics_host={host}"],  # its admin HTTP (remove_all, get_all_keys): not beyond host
                           Path(workdir, "master.log")))
        _wait_port(host, rpc, startup_timeout_s, Path(workdir, "master.log"), pids[0])
        _wait_port(host, http, startup_timeout_s, Path(workdir, "master.log"), pids[0])
        pids.append(_spawn([client_bin, f"-host={host}", f"-port={client_port}", f"-master_server_address={master}",
                            f"-metadata_server={metadata_url}", f"-global_segment_size={capacity_bytes}",
                            "-protocol=tcp"], Path(workdir, "client.log")))
        _wait_port(host, client_port, startup_timeout_s, Path(workdir, "client.log"), pids[1])
    except BaseException:
        MooncakeStore(master, metadata_url, tuple(pids), workdir).stop()
        raise
    logger.info("mooncake store: master %s, %d MiB held by pid %d", master, capacity_bytes >> 20, pids[-1])
    return MooncakeStore(master, metadata_url, tuple(pids), workdir)


_CHILDREN: dict[int, subprocess.Popen] = {}
GLOG_PROBLEM = ("W", "E", "F")  # glog's levels past INFO begin its lines


def _glog_problems(log: Path, lines: int = 20) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line[:1] in GLOG_PROBLEM and line[1:2].isdigit()][-lines:]


def _spawn(cmd: list[str], log: Path) -> int:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
    _CHILDREN[proc.pid] = proc
    return proc.pid


def _wait_port(host: str, port: int, timeout_s: float, log: Path, pid: int) -> None:
    """Until `pid` (which writes `log`) listens on `port`; MooncakeStoreError if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        if _CHILDREN[pid].poll() is not None:
            raise MooncakeStoreError(f"{log.stem} exited with code {_CHILDREN[pid].returncode}: {log_tail(log)}")
        time.sleep(0.05)
    raise MooncakeStoreError(f"nothing listened on {host}:{port} within {timeout_s:.0f} s: {log_tail(log)}")


def _stop(pid: int, timeout_s: float) -> None:
    proc = _CHILDREN.pop(pid, None)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if proc is None:
        return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
