"""The roles with an engine core (`both`, `prefill`, `decode`): requests in, tokens out, KV moved as the role
says. What is common to them is here; each role's module says how its engine moves KV and which commands only it
takes.

A round: report failed hand-offs, send the diagnostics' replies, run one engine step if anything is runnable (an
expert-parallel rank steps every round: the other ranks' steps wait for it), push the step's outputs with the
load, then save new blocks to the KV store once the outputs are out.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import torch

from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.engine.core import EngineCore, KVTransferConfig
from kvbaton.kv.connectors import ConnectorConfig
from kvbaton.messages.router_worker import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    ImageEmbedding,
    IntegrityReport,
    RequestFailed,
    TransferFailed,
    WorkerHello,
    WorkerLoad,
    WorkerOutputs,
)
from kvbaton.messages.worker_spec import WorkerSpec
from kvbaton.mm.embeddings import EmbeddingBytes, from_bytes
from kvbaton.mm.images import DecodedImage
from kvbaton.models.registry import resolve_model
from kvbaton.paths import cache_root
from kvbaton.platform.startup import StartupClock
from kvbaton.sched.outputs import TransferFailure
from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.text.tokenizer import eos_token_ids
from kvbaton.worker.probes import WorkerProbes
from kvbaton.worker.roles.base import Handler, Role, WorkerContext

logger = logging.getLogger("kvbaton.worker")
BUSY_POLL_MS = 2  # while transfers are in flight but nothing is runnable
IDLE_POLL_MS = 500  # idle: wake up now and then (to notice a dead launcher)
# an idle expert-parallel rank steps every round (one all-reduce): every 5 ms while its group was busy in the
# last second, then every 50 ms (measured, tiny model, 2 ranks: 15% of a core each at 5 ms). The price: the
# first request after a quiet second waits up to 50 ms for the other ranks to join its step.
EP_IDLE_POLL_MS = 5
EP_QUIET_POLL_MS = 50
EP_QUIET_AFTER_S = 1.0


def kv_connector(spec: WorkerSpec, secret: bytes) -> ConnectorConfig:
    """The deployment's KV transport settings, as this worker's connector (and its diagnostics') use them."""
    c = spec.connector
    return ConnectorConfig(transport=c.transport, secret=secret, host=c.host, redis_url=c.redis_url,
                           redis_ttl_s=c.redis_ttl_s, worker_name=spec.name,
                           allow_insecure_transport=c.allow_insecure_transport, encrypt_traffic=spec.encrypt_traffic)


def received_embeddings(sent: list[ImageEmbedding]) -> list[tuple[str, torch.Tensor]]:
    """An encoder worker's embeddings as tensors, by digest (ValueError for bytes that are not what they claim)."""
    return [(e.digest, from_bytes(EmbeddingBytes(e.dtype, e.rows, e.cols, e.data))) for e in sent]


def worker_engine_config(spec: WorkerSpec) -> EngineConfig:
    """The pool's engine config, with what is this worker's own: its disk tier's directory (by name, so a
    restarted worker finds its blocks again)."""
    store = spec.engine.kv_store
    if "disk" not in store.tiers:
        return spec.engine
    root = Path(store.disk_dir) if store.disk_dir else cache_root() / "kv-store"
    return dataclasses.replace(spec.engine, kv_store=dataclasses.replace(store, disk_dir=str(root / spec.name)))


class EngineRole(Role):
    """A role whose work is an engine core's steps. Subclasses say how it moves KV (`sends_kv`, `receives_kv`)
    and add the commands only they take (`role_commands`)."""

    sends_kv = False
    receives_kv = False

    def start(self, spec: WorkerSpec, secret: bytes, startup: StartupClock) -> None:
        self.spec = spec
        model_dir = resolve_model(spec.engine.model)
        eos = eos_token_ids(ModelConfig.from_dir(model_dir), model_dir)
        self.core = EngineCore(worker_engine_config(spec), model_dir, eos, self.kv_transfer(spec, secret), startup)
        self.probes = WorkerProbes(spec, self.core, kv_connector(spec, secret))  # the diagnostics (`probes.py`)
        self._loaded_at = time.monotonic()

    def kv_transfer(self, spec: WorkerSpec, secret: bytes) -> KVTransferConfig | None:
        """How this role's engine moves KV (None: it moves none)."""
        if not (self.sends_kv or self.receives_kv):
            return None
        return KVTransferConfig(kv_connector(spec, secret), send=self.sends_kv, receive=self.receives_kv)

    def hello(self, worker: WorkerContext, index: int, pid: int, address: str) -> WorkerHello:
        core = self.core
        return WorkerHello(name=worker.name, role=self.role, index=index, pid=pid, address=address, info=core.info,
                           layout=core.kv_layout, receiver=core.handoff.receiver_address, load=worker.report_load(),
                           startup=core.startup.phases)

    def commands(self, worker: WorkerContext) -> dict[type, Handler]:
        return {AddRequest: lambda msg: self._add(worker, msg), AbortRequests: lambda msg: self._abort(worker, msg),
                CheckIntegrity: lambda msg: self._check_integrity(worker), **self.probes.commands(),
                **self.role_commands(worker)}

    def role_commands(self, worker: WorkerContext) -> dict[type, Handler]:
        """Handlers for the router commands only this role takes."""
        return {}

    def serving(self, worker: WorkerContext) -> None:
        # NOTE: after the hello, not before: a served engine expects structured requests, so their compiler's
        # tokenizer loads now, in its own thread, rather than with the first such request; a request needs
        # none of it before its first token, so the worker does not wait for it to join the pool
        self.core.grammars.start()
        # NOTE: the KV pools' pages were left for the kernel to zero on first touch (a fast start); take them now,
        # in the background, so the worker's memory is what it will be under load (a leak shows as growth)
        threading.Thread(target=self.core.prefault_kv_pools, name="kvbaton-kv-prefault", daemon=True).start()

    # ---- a round -----------------------------------------------------------------------------

    def run_round(self, worker: WorkerContext) -> None:
        self._report_failures(worker, self.core.poll_handoffs())
        for reply in self.probes.replies():
            worker.send(reply)
        # NOTE: an expert-parallel rank steps every round, busy or not: the others' steps wait for it
        if self.core.expert_parallel is not None or self.core.has_unfinished_requests():
            self._step(worker)

    def _step(self, worker: WorkerContext) -> None:
        had_work = self.core.has_own_requests()
        result = self.probes.step(self.core.step)
        # NOTE: failures first: the router then falls back before it sees a hand-off's first token
        self._report_failures(worker, result.failed_transfers)
        for failure in result.failed_requests:
            worker.send(RequestFailed(worker.name, failure.request_id, failure.reason, in_step=failure.in_step))
        if result.outputs or had_work:
            worker.send(WorkerOutputs(worker.name, result.outputs, worker.report_load()))
        elif time.monotonic() - self._loaded_at > self.spec.heartbeat_s:
            # an EP rank serving only others' tokens: its counters move, and the heartbeat carries them
            worker.report_load()
        # once the outputs are out, so a first token does not wait for the copies; the next heartbeat
        # carries the store's counters with them
        if self.core.save_to_store():
            worker.report_load()

    def wait_ms(self) -> int:
        if self.core.has_unfinished_requests():
            return 0
        group = self.core.expert_parallel
        if group is not None:
            return EP_QUIET_POLL_MS if time.monotonic() - group.last_busy > EP_QUIET_AFTER_S else EP_IDLE_POLL_MS
        return BUSY_POLL_MS if self.core.handoff.in_flight or self.probes.active else IDLE_POLL_MS

    def idle(self) -> bool:
        return not (self.core.has_unfinished_requests() or self.core.handoff.in_flight)

    def load(self, seq: int) -> WorkerLoad:
        self._loaded_at = time.monotonic()
        return WorkerLoad(self.core.stats(), self.core.handoff.num_receiving, self.core.handoff.num_sending, seq)

    def close(self) -> None:
        self.core.close()

    # ---- commands ----------------------------------------------------------------------------

    def _add(self, worker: WorkerContext, msg: AddRequest) -> None:
        # NOTE: a request's images are encoded here, on the worker's loop, before its steps (`--encode 0`): an
        # encoder worker (E/P/D) takes that time off the steps of the requests running beside it
        # an encoder worker's embeddings instead (E/P/D) are only checked and held
        images = [DecodedImage(p.digest, p.width, p.height, p.rgb) for p in msg.images]
        try:
            embeddings = received_embeddings(msg.embeddings)
            digests = [im.digest for im in images] or [digest for digest, _ in embeddings]
            sizes = [(im.width, im.height) for im in images] or [(e.width, e.height) for e in msg.embeddings]
            req = self.core.new_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority,
                                        msg.remote_decode, digests, sizes)
            self.core.add_request(req, images, embeddings)
        except (InvalidRequestError, ValueError, RuntimeError) as exc:  # RuntimeError: an image the tower refused
            logger.warning("refused request %s: %s", msg.request_id, exc)
            worker.send(RequestFailed(worker.name, msg.request_id, str(exc)))

    def _abort(self, worker: WorkerContext, msg: AbortRequests) -> None:
        self.core.abort_requests(msg.request_ids, msg.reason)
        worker.send(WorkerOutputs(worker.name, [], worker.report_load()))  # let the router see the freed KV

    def _check_integrity(self, worker: WorkerContext) -> None:
        try:
            self.core.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        worker.send(IntegrityReport(worker.name, error, self.core.kv_cache_usage, self.core.num_requests))

    def _report_failures(self, worker: WorkerContext, failures: list[TransferFailure]) -> None:
        for failure in failures:
            worker.send(TransferFailed(worker.name, failure.request_id, failure.reason))
