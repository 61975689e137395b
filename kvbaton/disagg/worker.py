"""A worker process: one engine core in a role (prefill, decode, or both), driven by the router.

    python -m kvbaton.disagg.worker      (spec in $KVBATON_WORKER_SPEC, secret in $KVBATON_CLUSTER_SECRET)

Both come through the environment, never argv: `ps` shows every process's command line to
every user, and a spec can hold credentials (a Redis URL with its password).

Sockets: a PULL socket bound on the address it was given (port chosen by the OS) for commands,
and a PUSH socket to the router for events. Every frame is signed (`kvbaton.wire`); a frame that
fails verification is logged and dropped and the worker goes on.

The loop: take every pending command, move KV transfers along (connector polls), run one
engine step if anything is runnable, push its outputs. A heartbeat with the worker's last
known load goes out every `heartbeat_s` from a thread of its own (with its own socket: ZeroMQ
sockets are not thread-safe), so a long prefill step does not look like a dead worker, while a
stopped or killed process falls silent and the router notices within its `dead_after_s`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import msgspec
import zmq

from kvbaton.config import ModelConfig
from kvbaton.disagg.messages import (
    AbortRequests,
    AddRequest,
    CancelReceive,
    CheckIntegrity,
    Drain,
    Drained,
    FromWorker,
    Heartbeat,
    IntegrityReport,
    PrepareReceive,
    ReceiveReady,
    ReceiveRefused,
    RequestFailed,
    Shutdown,
    StartDecode,
    ToWorker,
    TransferFailed,
    WorkerHello,
    WorkerLoad,
    WorkerOutputs,
)
from kvbaton.disagg.spec import SPEC_ENV, WorkerSpec
from kvbaton.engine.core import EngineCore
from kvbaton.engine.request import Request, RequestStatus
from kvbaton.engine.sampling_params import InvalidRequestError
from kvbaton.engine.tokenizer import Tokenizer, eos_token_ids
from kvbaton.kv.connectors import ConnectorConfig, make_receiver, make_sender
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools
from kvbaton.models.registry import resolve_model
from kvbaton.wire import MAX_CONTROL_FRAME_BYTES, SECRET_ENV, SignedCodec

logger = logging.getLogger("kvbaton.worker")
BUSY_POLL_MS = 2  # while transfers are in flight but nothing is runnable
IDLE_POLL_MS = 500  # idle: wake up now and then (to notice a dead launcher)


class Worker:
    def __init__(self, spec: WorkerSpec, secret: bytes, core: EngineCore, ctx: zmq.Context,
                 exit_with_parent: bool = False) -> None:
        self.spec, self.core, self.name = spec, core, spec.name
        self.commands = ctx.socket(zmq.PULL)
        self.commands.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)
        port = self.commands.bind_to_random_port(f"tcp://{spec.host}")
        self.address = f"tcp://{spec.host}:{port}"
        self.events = ctx.socket(zmq.PUSH)
        self.events.setsockopt(zmq.LINGER, 1000)
        self.events.connect(spec.router)
        self.codec_in = SignedCodec(secret, ToWorker)
        self.codec_out = SignedCodec(secret, FromWorker)
        self.layout = core.kv_layout
        conn = ConnectorConfig(spec.connector.transport, secret, spec.connector.host, spec.connector.redis_url,
                               spec.connector.redis_ttl_s, spec.name)
        self.sender = make_sender(conn, self.layout, core.runner.kv_caches) if spec.role == "prefill" else None
        self.receiver = make_receiver(conn, self.layout, core.runner.kv_caches) if spec.role == "decode" else None
        core.runner.kv_sender = self.sender
        self.first_tokens: dict[str, int] = {}  # decode side: StartDecode seen, KV maybe not yet
        self.kv_arrived: set[str] = set()  # decode side: KV in, StartDecode maybe not yet
        self.running = True
        self.draining = False
        self._parent_pid = os.getppid() if exit_with_parent else None
        self.last_load = self._load()  # what the heartbeat thread reports; replaced, never mutated
        self._stop = threading.Event()
        # NOTE: the thread gets its own codec too; encoders are not shared across threads.
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(ctx, SignedCodec(secret, FromWorker)),
                                           name="heartbeat", daemon=True)

    # ---- loop --------------------------------------------------------------------------------

    def run(self) -> None:
        self._send(WorkerHello(self.name, self.spec.role, self.spec.index, os.getpid(), self.address, self.core.info,
                               self.layout, self.receiver.address if self.receiver else None, self._load()))
        logger.info("%s ready: commands on %s", self.name, self.address)
        self._heartbeat.start()
        while self.running:
            if self._parent_pid is not None and os.getppid() != self._parent_pid:
                logger.error("launcher is gone; exiting")
                return
            runnable = self.core.has_unfinished_requests()
            self._drain_commands(0 if runnable else self._idle_wait_ms())
            self._move_transfers()
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                self._report_transfer_refusals()
                self._send(WorkerOutputs(self.name, outputs, self._load()))
            if self.draining and self._idle():
                self._send(Drained(self.name))
                self.draining = False

    def _idle_wait_ms(self) -> int:
        return BUSY_POLL_MS if self._transfers_in_flight() else IDLE_POLL_MS

    def _drain_commands(self, block_ms: int) -> None:
        while self.commands.poll(block_ms):
            block_ms = 0
            frame = self.commands.recv(copy=False)
            msg = self.codec_in.try_decode(frame.buffer, self.name)
            if msg is not None:
                self._handle(msg)

    # ---- commands ----------------------------------------------------------------------------

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, PrepareReceive):
            self._prepare(msg)
        elif isinstance(msg, StartDecode):
            self.first_tokens[msg.request_id] = msg.first_token_id
            self._admit_ready()
        elif isinstance(msg, CancelReceive):
            for request_id in msg.request_ids:
                self._cancel_receive(request_id)
        elif isinstance(msg, AbortRequests):
            self._abort(msg)
        elif isinstance(msg, Drain):
            self.draining = True
        elif isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, CheckIntegrity):
            self._send(self._integrity())

    def _integrity(self) -> IntegrityReport:
        scheduler = self.core.scheduler
        try:
            self.core.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        num = len(scheduler.running) + len(scheduler.waiting) + len(scheduler.held) + len(scheduler.receiving)
        return IntegrityReport(self.name, error, self.core.kv_cache.usage(), num)

    def _new_request(self, request_id, prompt_token_ids, params, priority) -> Request:
        return Request(request_id, prompt_token_ids, params, self.core.info.eos_token_ids, priority)

    def _add(self, msg: AddRequest) -> None:
        req = self._new_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority)
        req.remote_decode = msg.remote_decode
        try:
            self.core.add_request(req)
        except (InvalidRequestError, ValueError) as exc:
            self._send(RequestFailed(self.name, msg.request_id, str(exc)))

    def _prepare(self, msg: PrepareReceive) -> None:
        if self.receiver is None:
            self._send(ReceiveRefused(self.name, msg.request_id, f"{self.name} is not a decode worker"))
            return
        req = self._new_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority)
        try:
            self.core.validate(req)
            reserved = self.core.scheduler.reserve_for_transfer(req)
        except (InvalidRequestError, ValueError) as exc:
            self._send(RequestFailed(self.name, msg.request_id, str(exc)))
            return
        if reserved is None:
            self._send(ReceiveRefused(self.name, msg.request_id, "no free KV blocks"))
            return
        num_cached, dst_block_ids = reserved
        self.receiver.expect(msg.request_id, dst_block_ids, msg.deadline_s)
        self._send(ReceiveReady(self.name, msg.request_id, num_cached, dst_block_ids))

    def _cancel_receive(self, request_id: str) -> None:
        if self.receiver is not None:
            self.receiver.cancel(request_id)
        self.core.scheduler.cancel_receive(request_id)
        self.first_tokens.pop(request_id, None)
        self.kv_arrived.discard(request_id)

    def _abort(self, msg: AbortRequests) -> None:
        status = RequestStatus.FINISHED_STOPPED if msg.reason == "stop" else RequestStatus.FINISHED_ABORTED
        for request_id in msg.request_ids:
            self._cancel_receive(request_id)
            if self.sender is not None and request_id in self.core.scheduler.held:
                self.sender.abort(request_id)
                self.core.scheduler.release_held(request_id)
        self.core.abort_requests(msg.request_ids, status)
        self._send(WorkerOutputs(self.name, [], self._load()))  # let the router see the freed KV

    # ---- transfers ---------------------------------------------------------------------------

    def _move_transfers(self) -> None:
        scheduler = self.core.scheduler
        if self.sender is not None:
            result = self.sender.poll()
            for request_id in result.completed:
                scheduler.release_held(request_id)
            for request_id, reason in result.failed:
                scheduler.release_held(request_id)
                self._send(TransferFailed(self.name, request_id, reason))
        if self.receiver is not None:
            result = self.receiver.poll()
            self.kv_arrived.update(r for r in result.completed if r in scheduler.receiving)
            for request_id, reason in result.failed:
                self._cancel_receive(request_id)
                self._send(TransferFailed(self.name, request_id, reason))
            self._admit_ready()

    def _admit_ready(self) -> None:
        for request_id in [r for r in self.kv_arrived if r in self.first_tokens]:
            self.kv_arrived.discard(request_id)
            self.core.scheduler.admit_transferred(request_id, self.first_tokens.pop(request_id))

    def _report_transfer_refusals(self) -> None:
        failed, self.core.runner.failed_transfers = self.core.runner.failed_transfers, []
        for request_id, reason in failed:
            self.core.scheduler.release_held(request_id)
            self._send(TransferFailed(self.name, request_id, reason))

    def _transfers_in_flight(self) -> bool:
        scheduler = self.core.scheduler
        return bool(scheduler.held or scheduler.receiving)

    # ---- state out ---------------------------------------------------------------------------

    def _idle(self) -> bool:
        return not (self.core.has_unfinished_requests() or self._transfers_in_flight())

    def _load(self) -> WorkerLoad:
        scheduler = self.core.scheduler
        self.last_load = WorkerLoad(self.core.stats(), len(scheduler.receiving), len(scheduler.held))
        return self.last_load

    def _heartbeat_loop(self, ctx: zmq.Context, codec: SignedCodec) -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.router)
        try:
            while not self._stop.wait(self.spec.heartbeat_s):
                sock.send(codec.encode(Heartbeat(self.name, self.last_load)))
        finally:
            sock.close()

    def _send(self, msg) -> None:
        self.events.send(self.codec_out.encode(msg), copy=False)

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=2 * self.spec.heartbeat_s + 1)
        for conn in (self.sender, self.receiver):
            if conn is not None:
                conn.close()
        self.commands.close(linger=0)
        self.events.close()


def build_core(spec: WorkerSpec) -> EngineCore:
    """The worker's engine; a shm prefill worker's KV pools live in shared memory (decode workers
    then copy blocks straight out of them)."""
    model_dir = resolve_model(spec.engine.model)
    eos = eos_token_ids(ModelConfig.from_dir(model_dir), Tokenizer(model_dir))
    if spec.role != "prefill" or spec.connector.transport != "shm":
        return EngineCore(spec.engine, model_dir, eos)
    from kvbaton.kv.connectors.shm import allocate_shared_kv_caches

    def allocate(layout: KVLayout, num_blocks: int) -> KVPools:
        return allocate_shared_kv_caches(layout, num_blocks, spec.name)

    return EngineCore(spec.engine, model_dir, eos, kv_allocator=allocate)


def run_worker(spec: WorkerSpec, secret: bytes, exit_with_parent: bool = False) -> None:
    """Run a worker until the router tells it to shut down (blocking)."""
    try:
        import setproctitle

        setproctitle.setproctitle(spec.name)
    except ImportError:
        pass
    # NOTE: SIGTERM (a launcher's polite stop) unwinds like SIGINT, so sockets, shared-memory
    # segments and connector threads are released in `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    core = build_core(spec)
    ctx = zmq.Context()
    worker = Worker(spec, secret, core, ctx, exit_with_parent)
    try:
        worker.run()
    finally:
        worker.close()
        ctx.term()
        core.runner.pools.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvbaton worker (prefill / decode / both)")
    parser.add_argument("--spec-json", default=os.environ.get(SPEC_ENV),
                        help=f"the WorkerSpec as JSON (default: ${SPEC_ENV}; prefer the environment)")
    parser.add_argument("--exit-with-parent", action="store_true")
    args = parser.parse_args(argv)
    if not args.spec_json:
        parser.exit(2, f"kvbaton worker: no spec (set {SPEC_ENV} or pass --spec-json)\n")
    spec = msgspec.json.decode(args.spec_json.encode(), type=WorkerSpec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.name} %(levelname)s %(message)s")
    secret = os.environ.get(SECRET_ENV, "").encode()
    if not secret:
        parser.exit(2, f"kvbaton worker: {SECRET_ENV} is not set (the launcher passes the cluster secret)\n")
    run_worker(spec, secret, args.exit_with_parent)


if __name__ == "__main__":
    main()
