"""`WorkerHost`: the Ray actor that runs one rank of a worker as its child process.

The actor starts `kvbaton.worker.main` as a child, so the worker gets its own title
(`kvbaton-decode-0` in `ps`, not `ray::...`), its own main thread and signal handlers, and a clean
exit (SIGINT: its `finally` closes the sockets and KV buffers; SIGKILL after a grace period); it
exits by itself if the actor dies. The cluster secret rides in the actor's constructor arguments
(never argv, never a repr, so never a log) and reaches the worker through its environment.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import NamedTuple

import msgspec
import ray

from kvbaton.cluster.ray.loopback import LOOPBACK, is_loopback
from kvbaton.cluster.worker_env import worker_env
from kvbaton.messages.worker_spec import WorkerSpec

# The worker's entry point with SIGINT working again: a Ray worker ignores it, and blocks it in
# the threads that run actor methods; a child inherits both, leaving only SIGKILL to stop it.
_WORKER_BOOTSTRAP = ("import signal; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                     "signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "from kvbaton.worker.main import main; main()")


class HostInfo(NamedTuple):
    actor_id: str | None
    node_id: str
    node_ip: str
    pid: int


class _Secret:
    """The cluster secret on its way to an actor: pickled by Ray, never shown by a repr."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = value

    def __repr__(self) -> str:
        return "<cluster secret>"

    def reveal(self) -> bytes:
        return self._value


def bind_to_node(spec: WorkerSpec, node_ip: str) -> WorkerSpec:
    """A loopback host in a spec means "this node": on a node with a network address, bind there."""
    if node_ip == LOOPBACK:
        return spec
    connector = spec.connector
    if is_loopback(connector.host):
        connector = msgspec.structs.replace(connector, host=node_ip)
    host = node_ip if is_loopback(spec.host) else spec.host
    return msgspec.structs.replace(spec, host=host, connector=connector)


@ray.remote(max_concurrency=4, max_restarts=0)  # type: ignore[call-overload]  # Ray's stubs know no actor options
class WorkerHost:
    """Hosts one worker process (one rank) inside its placement-group bundle; threaded, so
    `wait` can block while `stop` and `info` answer."""

    def __init__(self, spec_json: bytes, secret: _Secret) -> None:
        context = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        spec = bind_to_node(msgspec.json.decode(spec_json, type=WorkerSpec), node_ip)
        cmd = [sys.executable, "-c", _WORKER_BOOTSTRAP, "--exit-with-parent"]
        self.proc = subprocess.Popen(cmd, env=worker_env(spec, secret.reveal()))
        self._info = HostInfo(context.get_actor_id(), context.get_node_id(), node_ip, self.proc.pid)

    def info(self) -> HostInfo:
        return self._info

    def wait(self) -> int:
        """The worker's exit code, once it exits."""
        return self.proc.wait()

    def stop(self, grace_s: float) -> int:
        """SIGINT, then SIGKILL after `grace_s` (at once if 0); the worker's exit code."""
        if self.proc.poll() is None and grace_s > 0:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()  # a no-op once it has exited
        return self.proc.wait()
