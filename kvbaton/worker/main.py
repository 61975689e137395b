"""A worker process: one role (prefill, decode, both; `roles/`), driven by the router.

    python -m kvbaton.worker.main      (spec in $KVBATON_WORKER_SPEC, secret in $KVBATON_CLUSTER_SECRET)

Both come through the environment, never argv: `ps` shows every process's command line to
every user, and a spec can hold credentials (a Redis URL with its password).

Sockets: a PULL socket bound on the address it was given (port chosen by the OS) for commands,
and a PUSH socket to the router for events. Every frame is signed (`kvbaton.wire`); a frame that
fails verification is logged and dropped and the worker goes on. With `spec.encrypt_traffic` these
sockets (and the heartbeat's) are CURVE-encrypted besides (`kvbaton.wire.curve`).

This module is the shell every role shares (the contract: `roles/base.py`). The loop: take every pending command
(waiting as long as the role says it may), then let the role do one round of work (for the engine roles: move KV
hand-offs along, run one engine step if anything is runnable, push its outputs). Drain and shutdown are the
shell's; the commands a role takes, and everything it computes with, are the role's. A heartbeat goes out from a
thread of its own (`heartbeat.py`), carrying the load the role last reported.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvbaton.kv.store.shm_tier import arena_owner_pid, remove_arenas
from kvbaton.messages.router_worker import (
    Drain,
    Drained,
    PrepareReceive,
    ReceiveRefused,
    RequestFailed,
    Shutdown,
    ToWorker,
    WorkerLoad,
)
from kvbaton.messages.worker_spec import ROUTER_NAME, SPEC_ENV, WorkerSpec
from kvbaton.platform.process import freeze_long_lived_objects, set_compute_threads
from kvbaton.platform.startup import StartupClock
from kvbaton.wire import (
    MAX_CONTROL_FRAME_BYTES,
    SECRET_ENV,
    SESSION_BYTES,
    ChannelError,
    CurveUnavailable,
    MalformedMessage,
    Peer,
    SequencedCodec,
    curve_client,
    curve_keys,
    curve_server,
    require_curve,
)
from kvbaton.worker.heartbeat import HeartbeatThread
from kvbaton.worker.lifeline import exit_with_launcher, launcher_pid, when_orphaned
from kvbaton.worker.roles import Role, role_of

logger = logging.getLogger("kvbaton.worker")


class Worker:
    """The shell around a role: sockets, codec, heartbeat, drain and shutdown (`WorkerContext` to the role)."""

    def __init__(self, spec: WorkerSpec, secret: bytes, role: Role, ctx: zmq.Context) -> None:
        self.spec, self.role, self.name = spec, role, spec.name
        curve = curve_keys(secret, spec.encrypt_traffic)
        self.commands = ctx.socket(zmq.PULL)
        self.commands.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)
        curve_server(self.commands, curve)
        port = self.commands.bind_to_random_port(f"tcp://{spec.host}")
        self.address = f"tcp://{spec.host}:{port}"
        self.events = ctx.socket(zmq.PUSH)
        self.events.setsockopt(zmq.LINGER, 1000)
        curve_client(self.events, curve)
        self.events.connect(spec.router)
        # NOTE: a fresh session per process: frames captured from an earlier worker of this name are
        # addressed to another session; commands are taken only from the router session in the spec.
        self.codec = SequencedCodec(secret, ToWorker, Peer.fresh(self.name))
        self.codec.trust(router_peer(spec))
        self.running = True
        self.draining = False
        self._load_seq = 0
        self.last_load = self.report_load()  # what the heartbeat thread reports; replaced, never mutated
        self._heartbeat = HeartbeatThread(self.name, spec.router, spec.heartbeat_s, self.codec.for_stream(1), ctx,
                                          lambda: self.last_load, curve)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Drain: self._drain, Shutdown: self._shutdown, **role.commands(self)}

    def run(self) -> None:
        self.send(self.role.hello(self, self.spec.index, os.getpid(), self.address))
        logger.info("%s ready: commands on %s", self.name, self.address)
        self._heartbeat.start()
        self.role.serving(self)
        while self.running:
            self._drain_commands(self.role.wait_ms())
            self.role.run_round(self)
            if self.draining and self.role.idle():
                self.send(Drained(self.name))
                self.draining = False

    def _drain_commands(self, block_ms: int) -> None:
        while self.commands.poll(block_ms):
            block_ms = 0
            frame = self.commands.recv(copy=False)
            try:
                received = self.codec.decode(frame.buffer)
            except ChannelError as exc:
                logger.warning("%s: refused a frame (%d bytes): %s", self.name, len(frame.buffer), exc)
                if isinstance(exc, MalformedMessage) and exc.request_id is not None:
                    # NOTE: authentic but unreadable here (the router accepted a value this side refuses):
                    # fail its request now, or the client would wait for an answer that never comes
                    self.send(RequestFailed(self.name, exc.request_id, f"the worker could not read it: {exc}"))
                continue
            self._handle(received.msg)

    def _handle(self, msg: Any) -> None:
        """Run one command. One that raises is logged and, if it names a request, fails only that
        request: a command never takes the worker (and every request on it) down."""
        try:
            self._handlers.get(type(msg), self._not_for_this_role)(msg)
        except Exception as exc:
            logger.exception("%s: %s failed", self.name, type(msg).__name__)
            request_id = getattr(msg, "request_id", None)
            if isinstance(request_id, str):
                self.send(RequestFailed(self.name, request_id, f"{type(msg).__name__} failed: {exc}"))

    def _not_for_this_role(self, msg: Any) -> None:
        reason = f"{self.name} does not take {type(msg).__name__} (role {self.spec.role.value})"
        logger.warning("refused a command: %s", reason)
        if isinstance(msg, PrepareReceive):  # the router falls back to a local prefill
            self.send(ReceiveRefused(self.name, msg.request_id, reason))

    def _drain(self, msg: Drain) -> None:
        self.draining = True

    def _shutdown(self, msg: Shutdown) -> None:
        self.running = False

    # ---- what a role may use (`roles.base.WorkerContext`) ------------------------------------

    def report_load(self) -> WorkerLoad:
        self._load_seq += 1
        self.last_load = self.role.load(self._load_seq)
        return self.last_load

    def send(self, msg: msgspec.Struct) -> None:
        self.events.send(self.codec.encode(msg, ROUTER_NAME), copy=False)

    def close(self) -> None:
        self._heartbeat.stop()
        self.commands.close(linger=0)
        self.events.close()


def router_peer(spec: WorkerSpec) -> Peer:
    """The router's end of the control channel, as the launcher told this worker."""
    try:
        session = bytes.fromhex(spec.router_session)
    except ValueError:
        session = b""
    if len(session) != SESSION_BYTES:
        raise ValueError(f"{spec.name}: the spec's router_session must be {SESSION_BYTES} bytes of hex "
                         f"(the pool that launches a worker sets it), not {spec.router_session!r}")
    return Peer(ROUTER_NAME, session)


def run_worker(spec: WorkerSpec, secret: bytes) -> None:
    """Run a worker until the router tells it to shut down (blocking). A launcher's death ends it through
    `lifeline` (`main --exit-with-parent`), whose SIGTERM unwinds it as below."""
    try:
        import setproctitle

        setproctitle.setproctitle(spec.name)
    except ImportError:
        pass
    # NOTE: SIGTERM (a launcher's polite stop) unwinds like SIGINT, so sockets, shared-memory
    # segments and connector threads are released in `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    startup = StartupClock.since_exec()
    set_compute_threads(spec.engine.num_threads)
    role = role_of(spec.role)
    role.start(spec, secret, startup)
    freeze_long_lived_objects()
    ctx = zmq.Context()
    worker = Worker(spec, secret, role, ctx)
    startup.lap("sockets")
    logger.debug("%s started in %.2f s: %s", spec.name, startup.total_s, startup.summary())
    try:
        worker.run()
    finally:
        worker.close()
        role.close()
        ctx.term()


def remove_launchers_arena_when_orphaned(spec: WorkerSpec) -> None:
    """The shm arena `kvbaton serve` names for its own workers (`serve-<its pid>-...`) goes with it: a SIGKILLed serve
    removes nothing, so each of its workers removes the arena as the launcher's death takes it down (the first one
    wins; the others' mappings stay valid until they exit). An arena the operator named is shared on purpose and
    stays."""
    name = spec.engine.kv_store.shm_name
    if "shm" in spec.engine.kv_store.tiers and name is not None and arena_owner_pid(name) == launcher_pid():
        when_orphaned(functools.partial(remove_arenas, name))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvbaton worker (prefill / decode / both)")
    parser.add_argument("--spec-json", default=os.environ.get(SPEC_ENV),
                        help=f"the WorkerSpec as JSON (default: ${SPEC_ENV}; prefer the environment)")
    parser.add_argument("--exit-with-parent", action="store_true")
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        exit_with_launcher()  # before the model loads: a launcher killed meanwhile must take us with it
    if not args.spec_json:
        parser.exit(2, f"kvbaton worker: no spec (set {SPEC_ENV} or pass --spec-json)\n")
    spec = msgspec.json.decode(args.spec_json.encode(), type=WorkerSpec)
    if args.exit_with_parent:
        remove_launchers_arena_when_orphaned(spec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.name} %(levelname)s %(message)s")
    secret = os.environ.get(SECRET_ENV, "").encode()
    if not secret:
        parser.exit(2, f"kvbaton worker: {SECRET_ENV} is not set (the launcher passes the cluster secret)\n")
    if spec.encrypt_traffic:
        try:
            require_curve()  # before the model loads
        except CurveUnavailable as exc:
            parser.exit(2, f"kvbaton worker: {exc}\n")
    run_worker(spec, secret)


if __name__ == "__main__":
    main()
