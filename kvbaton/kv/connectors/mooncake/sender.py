"""The mooncake transport's prefill side: offers its pool's blocks, announces layers, hears the verdict."""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvbaton.kv.connectors.base import ConnectorConfig, KVSender, PollResult, TransferSpec
from kvbaton.kv.connectors.mooncake import MAX_FRAME_BYTES, Cancel, Done, Failed, LayerReady, Offer, ToSender
from kvbaton.kv.connectors.mooncake.engine import Engine
from kvbaton.kv.pools import KVPools
from kvbaton.wire import IOThread, SignedCodec, curve_keys

logger = logging.getLogger(__name__)


@dataclass
class _Outgoing:
    spec: TransferSpec
    deadline: float


class Sender(KVSender):
    receiver_converts_dtype = False  # the receiver reads our pool's bytes straight into its own

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        super().__init__(config, pools)
        self._engine = Engine(config.host, pools, config.allow_insecure_transport)
        self._codec = SignedCodec(config.secret, ToSender, MAX_FRAME_BYTES)
        self._inbox: queue.SimpleQueue[Done | Failed] = queue.SimpleQueue()
        self._transfers: dict[str, _Outgoing] = {}
        self.io = IOThread(f"{config.worker_name}-kv-mooncake", curve_keys(config.secret, config.encrypt_traffic))
        self.io.start()

    def begin(self, spec: TransferSpec) -> None:
        self.check_begin(spec)
        if spec.request_id in self._transfers:  # the receiver hears Cancel before the new Offer
            self._cancel(spec.request_id, "superseded by a new transfer of the same request")
        self._transfers[spec.request_id] = _Outgoing(spec, time.monotonic() + spec.deadline_s)
        offer = Offer(spec.request_id, self._engine.session, self.layout, self.pools.num_blocks, self._engine.addrs,
                      list(spec.src_block_ids), list(spec.dst_block_ids))
        self._send(spec.receiver, offer)

    def save_layer(self, layer: int, request_ids: list[str]) -> None:
        by_receiver: dict[str, list[str]] = {}
        for request_id in request_ids:
            t = self._transfers.get(request_id)
            if t is not None:
                by_receiver.setdefault(t.spec.receiver, []).append(request_id)
        for receiver, ids in by_receiver.items():
            self._send(receiver, LayerReady(ids, layer))

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        while not self._inbox.empty():
            msg = self._inbox.get()
            if self._transfers.pop(msg.request_id, None) is None:
                continue  # aborted, or already ended
            if isinstance(msg, Done):
                completed.append(msg.request_id)
            else:
                failed.append((msg.request_id, f"receiver: {msg.reason}"))
        now = time.monotonic()
        for request_id, t in list(self._transfers.items()):
            if now > t.deadline:
                reason = f"receiver did not confirm within {t.spec.deadline_s:.1f} s"
                failed.append((request_id, reason))
                self._cancel(request_id, reason)
        return PollResult(completed, failed)

    def abort(self, request_id: str) -> None:
        if request_id in self._transfers:
            self._cancel(request_id, "aborted by the prefill worker")

    def close(self) -> None:
        self.io.close()
        self._engine.close()

    def _cancel(self, request_id: str, reason: str) -> None:
        t = self._transfers.pop(request_id)
        self._send(t.spec.receiver, Cancel(request_id, reason))

    def _send(self, receiver: str, msg: msgspec.Struct) -> None:
        frame = self._codec.encode(msg)
        self.io.call(lambda: self._push(receiver, frame))

    def _push(self, receiver: str, frame: bytes) -> None:
        """I/O thread: one DEALER per receiver, its replies read by `_on_reply`."""
        try:
            self.io.peer(receiver, self._on_reply, MAX_FRAME_BYTES).send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # bad address, or peer not reading: the transfer times out
            logger.warning("%s: cannot send to %r: %s", self.config.worker_name, receiver[:100], exc)

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        msg = self._codec.try_decode(frames[0].buffer, f"{self.config.worker_name} mooncake control") \
            if len(frames) == 1 else None
        if msg is not None:
            self._inbox.put(msg)
