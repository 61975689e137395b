"""The prefill side of the ZeroMQ transports: per-transfer state, deadlines, acks, abort."""

from __future__ import annotations

import collections
import logging
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvbaton.kv.connectors.base import ConnectorConfig, KVSender, PollResult, TransferSpec
from kvbaton.kv.connectors.zmq_control import Ack, SenderFailed
from kvbaton.kv.layout import KVLayoutMismatch
from kvbaton.kv.pools import KVPools
from kvbaton.wire import IOThread, SignedCodec, curve_keys

logger = logging.getLogger(__name__)


@dataclass
class Outgoing:
    """One transfer. The engine thread owns it; the I/O thread reads `spec` and, under the sender's
    lock, `ended` (so nothing reads the source blocks once abort() has returned)."""

    spec: TransferSpec
    deadline: float
    layers_sent: set[int] = field(default_factory=set)
    ended: bool = False
    resources: Any = None  # the transport's (a staging segment)


class ZmqSender(KVSender):
    """Bookkeeping of the prefill side. A transport implements `_read_layer` (take the layer's source
    rows out of the pool; runs under the lock) and `_push_layer` (send it), both on the I/O thread."""

    host: str  # where the ack socket binds

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        super().__init__(config, pools)
        self.codec = SignedCodec(config.secret, Ack)
        self._transfers: dict[str, Outgoing] = {}
        # (request_id, ok, reason, said by the receiver): acks, and failures of the I/O thread
        self._inbox: collections.deque[tuple[str, bool, str, bool]] = collections.deque()
        self._lock = threading.Lock()
        self.io = IOThread(f"kv-{config.transport}-sender", curve_keys(config.secret, config.encrypt_traffic))
        self.ack_address = self.io.bind_pull(self.host, 2**16, self._on_ack)
        self.io.start()

    def begin(self, spec: TransferSpec) -> None:
        # NOTE: a second begin() of a live request is refused: layer messages name only the request,
        # so the receiver could not tell the two attempts' layers apart
        try:
            self.check_begin(spec, begun=self._transfers)
        except KVLayoutMismatch as exc:
            reason = str(exc)  # the decode side fails the request with the same message
            self.io.call(lambda: self._notify(spec.receiver, spec.request_id, reason))
            raise
        self._transfers[spec.request_id] = Outgoing(spec, time.monotonic() + spec.deadline_s)

    def save_layer(self, layer: int, request_ids: list[str]) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        transfers = [t for rid in request_ids if (t := self._transfers.get(rid)) is not None]
        if transfers:
            self.io.call(lambda: self._send_layer(layer, transfers))

    def poll(self) -> PollResult:
        completed, failed = [], []
        while self._inbox:
            request_id, ok, reason, from_receiver = self._inbox.popleft()
            t = self._transfers.pop(request_id, None)
            if t is None:  # already ended (e.g. a nack after the ack, or aborted)
                continue
            if ok:
                completed.append(request_id)
            else:
                failed.append((request_id, reason))
            self._end(t, notify=None if from_receiver else reason, receiver_done=from_receiver)
        now = time.monotonic()
        for request_id in [rid for rid, t in self._transfers.items() if now > t.deadline]:
            t = self._transfers.pop(request_id)
            reason = (f"no confirmation from the decode worker within {t.spec.deadline_s:g}s "
                      f"({len(t.layers_sent)}/{self.layout.num_layers} layers sent)")
            failed.append((request_id, reason))
            self._end(t, notify=reason, drop_peer=True)
        return PollResult(completed, failed)

    def abort(self, request_id: str) -> None:
        t = self._transfers.pop(request_id, None)
        if t is not None:
            self._end(t, notify="aborted by the prefill worker")

    def close(self) -> None:
        for t in list(self._transfers.values()):
            self._end(t, notify="the prefill worker's KV sender closed")
        self._transfers.clear()
        self.io.close()

    def _end(self, t: Outgoing, notify: str | None, drop_peer: bool = False, receiver_done: bool = False) -> None:
        """`notify`: tell the receiver why we gave up. `receiver_done`: it said it is done with the
        transfer (so it reads nothing more of it)."""
        with self._lock:  # waits for a read of this transfer's blocks in progress
            t.ended = True
        self.io.call(lambda: self._release_io(t, notify, drop_peer, receiver_done))

    def _release_io(self, t: Outgoing, notify: str | None, drop_peer: bool, receiver_done: bool) -> None:
        if notify is not None:
            self._notify(t.spec.receiver, t.spec.request_id, notify)
        self._release(t, receiver_done)
        live = list(self._transfers.values())  # one atomic copy: the engine thread mutates the dict
        if drop_peer and all(o.spec.receiver != t.spec.receiver for o in live):
            self.io.drop_peer(t.spec.receiver)  # frees what was queued for a peer that may be gone

    def _notify(self, receiver: str, request_id: str, reason: str) -> None:
        self.io.peer(receiver).send(self.codec.encode(SenderFailed(request_id, reason)), zmq.NOBLOCK)

    def _on_ack(self, frames: list[zmq.Frame]) -> None:
        ack = self.codec.try_decode(frames[0].buffer, f"{self.config.worker_name} KV sender") if len(frames) == 1 \
            else None
        if isinstance(ack, Ack):
            self._inbox.append((ack.request_id, ack.ok, f"decode worker: {ack.reason}", True))

    def _send_layer(self, layer: int, transfers: list[Outgoing]) -> None:
        for t in transfers:
            try:
                with self._lock:
                    if t.ended:
                        continue
                    data = self._read_layer(t, layer)
                self._push_layer(t, layer, data)
                t.layers_sent.add(layer)
            except Exception as exc:  # e.g. no room for a staging segment: fail this transfer only
                logger.exception("sending layer %d of %s failed", layer, t.spec.request_id)
                with self._lock:
                    t.ended = True  # and send none of its other layers
                self._inbox.append((t.spec.request_id, False, f"sending layer {layer} failed: {exc}", False))

    @abstractmethod
    def _read_layer(self, t: Outgoing, layer: int) -> Any:
        """Take layer `layer` of the transfer's source blocks out of the pool (I/O thread, under the lock)."""

    @abstractmethod
    def _push_layer(self, t: Outgoing, layer: int, data: Any) -> None:
        """Send what `_read_layer` returned to `t.spec.receiver` (I/O thread)."""

    def _release(self, t: Outgoing, receiver_done: bool) -> None:
        """Free the transport's per-transfer resources (I/O thread). Unless `receiver_done`, the
        receiver may still read what this transfer sent."""
