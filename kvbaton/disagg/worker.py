"""A worker process: one engine core in a role (prefill, decode, or both), driven by the router.

    python -m kvbaton.disagg.worker      (spec in $KVBATON_WORKER_SPEC, secret in $KVBATON_CLUSTER_SECRET)

Both come through the environment, never argv: `ps` shows every process's command line to
every user, and a spec can hold credentials (a Redis URL with its password).

Sockets: a PULL socket bound on the address it was given (port chosen by the OS) for commands,
and a PUSH socket to the router for events. Every frame is signed (`kvbaton.wire`); a frame that
fails verification is logged and dropped and the worker goes on. With `spec.encrypt_traffic` these
sockets (and the heartbeat's) are CURVE-encrypted besides (`kvbaton.wire.curve`).

The loop: take every pending command, move KV hand-offs along, run one engine step if anything
is runnable, push its outputs. The engine owns its KV connector (`EngineCore(kv_transfer=...)`);
the worker only maps messages onto the engine's operations and reports what they give back. What
differs by role (how the engine moves KV, the commands only some roles take) is in `roles/`.
A heartbeat goes out from a thread of its own (`heartbeat.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.disagg.heartbeat import HeartbeatThread
from kvbaton.disagg.lifeline import exit_with_launcher, launcher_pid, when_orphaned
from kvbaton.disagg.messages import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    Drain,
    Drained,
    IntegrityReport,
    PrepareReceive,
    ReceiveRefused,
    RequestFailed,
    Shutdown,
    ToWorker,
    TransferFailed,
    WorkerHello,
    WorkerLoad,
    WorkerOutputs,
)
from kvbaton.disagg.probes import WorkerProbes
from kvbaton.disagg.roles import Role, role_of
from kvbaton.disagg.spec import ROUTER_NAME, SPEC_ENV, WorkerSpec
from kvbaton.engine.core import EngineCore
from kvbaton.engine.outputs import TransferFailure
from kvbaton.engine.sampling_params import InvalidRequestError
from kvbaton.engine.tokenizer import eos_token_ids
from kvbaton.kv.store.shm_tier import arena_owner_pid, remove_arenas
from kvbaton.models.registry import resolve_model
from kvbaton.paths import cache_root
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

logger = logging.getLogger("kvbaton.worker")
BUSY_POLL_MS = 2  # while transfers are in flight but nothing is runnable
IDLE_POLL_MS = 500  # idle: wake up now and then (to notice a dead launcher)
# an idle expert-parallel rank steps every round (one all-reduce): every 5 ms while its group was busy in the
# last second, then every 50 ms (measured, tiny model, 2 ranks: 15% of a core each at 5 ms). The price: the
# first request after a quiet second waits up to 50 ms for the other ranks to join its step.
EP_IDLE_POLL_MS = 5
EP_QUIET_POLL_MS = 50
EP_QUIET_AFTER_S = 1.0


class Worker:
    def __init__(self, spec: WorkerSpec, secret: bytes, core: EngineCore, ctx: zmq.Context) -> None:
        self.spec, self.core, self.name, self.role = spec, core, spec.name, role_of(spec.role)
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
        self.last_load = self._load()  # what the heartbeat thread reports; replaced, never mutated
        self._heartbeat = HeartbeatThread(self.name, spec.router, spec.heartbeat_s, self.codec.for_stream(1), ctx,
                                          lambda: self.last_load, curve)
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddRequest: self._add, AbortRequests: self._abort, Drain: self._drain, Shutdown: self._shutdown,
            CheckIntegrity: self._check_integrity, **self.role.commands(self),
        }
        self.probes = WorkerProbes(spec, secret, core)  # the diagnostics' probes (`disagg.probes`)
        self._handlers.update(self.probes.commands())

    # ---- loop --------------------------------------------------------------------------------

    def run(self) -> None:
        self.send(WorkerHello(name=self.name, role=self.spec.role, index=self.spec.index, pid=os.getpid(),
                              address=self.address, info=self.core.info, layout=self.core.kv_layout,
                              receiver=self.core.receiver_address, load=self._load(),
                              startup=self.core.startup.phases))
        logger.info("%s ready: commands on %s", self.name, self.address)
        self._heartbeat.start()
        # NOTE: after the hello, not before: a served engine expects structured requests, so their compiler's
        # tokenizer loads now, in its own thread, rather than with the first such request; a request needs
        # none of it before its first token, so the worker does not wait for it to join the pool
        self.core.grammars.start()
        # NOTE: the KV pools' pages were left for the kernel to zero on first touch (a fast start); take them now,
        # in the background, so the worker's memory is what it will be under load (a leak shows as growth)
        threading.Thread(target=self.core.prefault_kv_pools, name="kvbaton-kv-prefault", daemon=True).start()
        while self.running:
            runnable = self.core.has_unfinished_requests()
            self._drain_commands(0 if runnable else self._idle_wait_ms())
            self._report_failures(self.core.poll_transfers())
            for reply in self.probes.replies():
                self.send(reply)
            # NOTE: an expert-parallel rank steps every round, busy or not: the others' steps wait for it
            if self.core.expert_parallel is not None or self.core.has_unfinished_requests():
                self._step()
            if self.draining and self._idle():
                self.send(Drained(self.name))
                self.draining = False

    def _step(self) -> None:
        had_work = self.core.has_own_requests()
        result = self.probes.step(self.core.step)
        # NOTE: failures first: the router then falls back before it sees a hand-off's first token
        self._report_failures(result.failed_transfers)
        for failure in result.failed_requests:
            self.send(RequestFailed(self.name, failure.request_id, failure.reason, in_step=failure.in_step))
        if result.outputs or had_work:
            self.send(WorkerOutputs(self.name, result.outputs, self._load()))
        elif time.monotonic() - self._load_time > self.spec.heartbeat_s:
            self._load()  # an EP rank serving only others' tokens: its counters move; the heartbeat carries them
        # once the outputs are out, so a first token does not wait for the copies; the next heartbeat
        # carries the store's counters with them
        if self.core.save_to_store():
            self._load()

    def _idle_wait_ms(self) -> int:
        group = self.core.expert_parallel
        if group is not None:
            return EP_QUIET_POLL_MS if time.monotonic() - group.last_busy > EP_QUIET_AFTER_S else EP_IDLE_POLL_MS
        return BUSY_POLL_MS if self.core.transfers_in_flight or self.probes.active else IDLE_POLL_MS

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

    # ---- commands ----------------------------------------------------------------------------

    def _add(self, msg: AddRequest) -> None:
        req = self.core.new_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority, msg.remote_decode)
        try:
            self.core.add_request(req)
        except (InvalidRequestError, ValueError) as exc:
            logger.warning("refused request %s: %s", msg.request_id, exc)
            self.send(RequestFailed(self.name, msg.request_id, str(exc)))

    def _not_for_this_role(self, msg: Any) -> None:
        reason = f"{self.name} does not take {type(msg).__name__} (role {self.spec.role.value})"
        logger.warning("refused a command: %s", reason)
        if isinstance(msg, PrepareReceive):  # the router falls back to a local prefill
            self.send(ReceiveRefused(self.name, msg.request_id, reason))

    def _abort(self, msg: AbortRequests) -> None:
        self.core.abort_requests(msg.request_ids, msg.reason)
        self.send(WorkerOutputs(self.name, [], self._load()))  # let the router see the freed KV

    def _drain(self, msg: Drain) -> None:
        self.draining = True

    def _shutdown(self, msg: Shutdown) -> None:
        self.running = False

    def _check_integrity(self, msg: CheckIntegrity) -> None:
        try:
            self.core.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        self.send(IntegrityReport(self.name, error, self.core.kv_cache_usage, self.core.num_requests))

    # ---- state out ---------------------------------------------------------------------------

    def _report_failures(self, failures: list[TransferFailure]) -> None:
        for failure in failures:
            self.send(TransferFailed(self.name, failure.request_id, failure.reason))

    def _idle(self) -> bool:
        return not (self.core.has_unfinished_requests() or self.core.transfers_in_flight)

    def _load(self) -> WorkerLoad:
        self._load_seq += 1
        self._load_time = time.monotonic()
        self.last_load = WorkerLoad(self.core.stats(), self.core.num_receiving, self.core.num_sending, self._load_seq)
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


def build_core(spec: WorkerSpec, role: Role, secret: bytes, startup: StartupClock | None = None) -> EngineCore:
    model_dir = resolve_model(spec.engine.model)
    eos = eos_token_ids(ModelConfig.from_dir(model_dir), model_dir)
    return EngineCore(worker_engine_config(spec), model_dir, eos, role.kv_transfer(spec, secret), startup)


def worker_engine_config(spec: WorkerSpec) -> EngineConfig:
    """The pool's engine config, with what is this worker's own: its disk tier's directory (by name, so a
    restarted worker finds its blocks again)."""
    store = spec.engine.kv_store
    if "disk" not in store.tiers:
        return spec.engine
    root = Path(store.disk_dir) if store.disk_dir else cache_root() / "kv-store"
    return dataclasses.replace(spec.engine, kv_store=dataclasses.replace(store, disk_dir=str(root / spec.name)))


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
    core = build_core(spec, role_of(spec.role), secret, startup)
    freeze_long_lived_objects()
    ctx = zmq.Context()
    worker = Worker(spec, secret, core, ctx)
    startup.lap("sockets")
    logger.debug("%s started in %.2f s: %s", spec.name, startup.total_s, startup.summary())
    try:
        worker.run()
    finally:
        worker.close()
        core.close()
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
