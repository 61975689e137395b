"""What the ZeroMQ-based transports (`shm`, `tcp`) share: the control messages and the bookkeeping
of both roles (deadlines, acks, cancel/abort, refusals). A transport adds how one layer travels.

    prefill worker                                          decode worker
    ZmqSender ── layer messages (PUSH) ────────────────▶  ZmqReceiver socket (PULL, bound: .address)
      ack socket (PULL, bound) ◀── Ack (PUSH, ack_to) ──

Threads: see `kvbaton.wire.io_thread`. Data lands in the receiver's pool only inside poll().
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from kvbaton.kv.connectors.base import ConnectorConfig, KVReceiver, KVSender, PollResult, TransferSpec
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from kvbaton.kv.rows import pool_rows, rows_within
from kvbaton.wire import SignedCodec
from kvbaton.wire.io_thread import IOThread

logger = logging.getLogger(__name__)

NOT_EXPECTING = "the decode worker is not expecting this request (cancelled, timed out or never expected)"


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Decode -> prefill: the transfer ended on the receiver; ok means every layer is in its pool."""

    request_id: str
    ok: bool
    reason: str = ""


class SenderFailed(msgspec.Struct, tag="sender_failed", frozen=True):
    """Prefill -> decode: the sender gave up (aborted, deadline, layout mismatch); stop waiting."""

    request_id: str
    reason: str



# -- the prefill side ------------------------------------------------------------------------------------


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

    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self.num_blocks = pool_rows(kv_caches, layout)
        self.codec = SignedCodec(config.secret, Ack)
        self._transfers: dict[str, Outgoing] = {}
        # (request_id, ok, reason, said by the receiver): acks, and failures of the I/O thread
        self._inbox: collections.deque[tuple[str, bool, str, bool]] = collections.deque()
        self._lock = threading.Lock()
        self.io = IOThread(f"kv-{config.transport}-sender")
        self.ack_address = self.io.bind_pull(self.host, 2**16, self._on_ack)
        self.io.start()

    def begin(self, spec: TransferSpec) -> None:
        if spec.request_id in self._transfers:
            raise ValueError(f"transfer {spec.request_id!r} already begun")
        try:
            self.layout.check_compatible(spec.layout)  # ours first: the message reads prefill vs decode
        except KVLayoutMismatch as exc:
            reason = str(exc)  # the decode side fails the request with the same message
            self.io.call(lambda: self._notify(spec.receiver, spec.request_id, reason))
            raise
        if len(spec.src_block_ids) != len(spec.dst_block_ids):
            raise ValueError(f"{len(spec.src_block_ids)} source blocks but {len(spec.dst_block_ids)} destinations")
        if not rows_within(spec.src_block_ids, self.num_blocks):
            raise ValueError(f"source block ids outside this pool of {self.num_blocks} blocks")
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


# -- the decode side -------------------------------------------------------------------------------------


@dataclass
class Incoming:
    dst_block_ids: list[int]
    deadline: float
    deadline_s: float
    layers: set[int] = field(default_factory=set)
    ack_to: str | None = None
    resources: Any = None  # the transport's (shm: the sender's pid)


class ZmqReceiver(KVReceiver):
    """Bookkeeping of the decode side. A transport implements `_on_frames` (I/O thread: check a message,
    return the inbox item `(header, payload)` or None) and `_write_layer` (engine thread, in poll())."""

    host: str
    decode_type: Any  # the msgspec union this receiver accepts

    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self.num_blocks = pool_rows(kv_caches, layout)
        self.codec = SignedCodec(config.secret, self.decode_type, self.max_header_bytes())
        self._expected: dict[str, Incoming] = {}
        self._inbox: collections.deque[tuple[Any, Any]] = collections.deque()
        self._nacked: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.io = IOThread(f"kv-{config.transport}-receiver")
        self.address = self.io.bind_pull(self.host, self.max_frame_bytes(), self._on_socket)
        self.io.start()

    def max_header_bytes(self) -> int:
        return 2**16 + 16 * self.num_blocks  # a layer message lists at most every block of the pool

    def max_frame_bytes(self) -> int:
        return self.max_header_bytes()

    def expect(self, request_id: str, dst_block_ids: list[int], deadline_s: float) -> None:
        if request_id in self._expected:
            raise ValueError(f"already expecting {request_id!r}")
        if not rows_within(dst_block_ids, self.num_blocks):
            raise ValueError(f"destination block ids outside this pool of {self.num_blocks} blocks")
        self._nacked.pop(request_id, None)
        deadline = time.monotonic() + deadline_s
        self._expected[request_id] = Incoming(list(dst_block_ids), deadline, deadline_s)

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        items = [self._inbox.popleft() for _ in range(len(self._inbox))]
        # NOTE: a sender's give-up wins over its layers still queued behind it: they are not copied
        # (the source blocks may already be reused, or the staging segment gone)
        given_up = {header.request_id for header, _ in items if isinstance(header, SenderFailed)}
        for header, payload in items:
            if isinstance(header, SenderFailed):
                if (st := self._expected.pop(header.request_id, None)) is not None:
                    failed.append((header.request_id, f"prefill worker: {header.reason}"))
                    self._forget(st)
            elif header.request_id not in given_up:
                self._on_layer(header, payload, completed, failed)
        now = time.monotonic()
        for request_id, st in [(rid, st) for rid, st in self._expected.items() if now > st.deadline]:
            self._fail(request_id, f"not every layer arrived within {st.deadline_s:g}s "
                                   f"({len(st.layers)}/{self.layout.num_layers} layers)", failed)
        self._housekeep(failed)
        return PollResult(completed, failed)

    def cancel(self, request_id: str) -> None:
        st = self._expected.pop(request_id, None)
        if st is not None:
            if st.ack_to is not None:
                self._ack(st.ack_to, Ack(request_id, False, "cancelled by the decode worker"))
            self._forget(st)

    def close(self) -> None:
        for request_id, st in self._expected.items():
            if st.ack_to is not None:  # queued before the stop, so sent (or dropped after the linger)
                self._ack(st.ack_to, Ack(request_id, False, "the decode worker's KV receiver closed"))
            self._forget(st)
        self._expected.clear()
        self.io.close()

    def _on_layer(self, header: Any, payload: Any, completed: list[str], failed: list[tuple[str, str]]) -> None:
        request_id = header.request_id
        st = self._expected.get(request_id)
        if st is None:
            self._nack_unknown(request_id, header.ack_to)
            return
        st.ack_to = header.ack_to
        try:
            header.layout.check_compatible(self.layout)
            if len(st.dst_block_ids) != header.num_blocks:
                raise ValueError(f"the sender has {header.num_blocks} blocks, this worker expects "
                                 f"{len(st.dst_block_ids)}")
            if not 0 <= header.layer < self.layout.num_layers:
                raise ValueError(f"layer {header.layer} outside 0..{self.layout.num_layers - 1}")
            self._write_layer(header, payload, st)
        except (ValueError, OSError) as exc:
            self._fail(request_id, str(exc), failed)
            return
        st.layers.add(header.layer)
        if len(st.layers) == self.layout.num_layers:
            del self._expected[request_id]
            completed.append(request_id)
            self._ack(header.ack_to, Ack(request_id, True))
            self._forget(st)

    def _fail(self, request_id: str, reason: str, failed: list[tuple[str, str]]) -> None:
        st = self._expected.pop(request_id)
        failed.append((request_id, reason))
        if st.ack_to is not None:
            self._ack(st.ack_to, Ack(request_id, False, reason))
        self._forget(st)

    def _nack_unknown(self, request_id: str, ack_to: str) -> None:
        if request_id in self._nacked:  # one nack per request, not one per layer
            return
        self._nacked[request_id] = None
        if len(self._nacked) > 4096:
            self._nacked.popitem(last=False)
        self._ack(ack_to, Ack(request_id, False, NOT_EXPECTING))

    def _ack(self, ack_to: str, ack: Ack) -> None:
        frame = self.codec.encode(ack)
        self.io.call(lambda: self.io.peer(ack_to).send(frame, zmq.NOBLOCK))

    def _on_socket(self, frames: list[zmq.Frame]) -> None:
        item = self._on_frames(frames)
        if item is not None:
            self._inbox.append(item)

    def _decode_header(self, frame: zmq.Frame) -> Any:
        return self.codec.try_decode(frame.buffer, f"{self.config.worker_name} KV receiver")

    @abstractmethod
    def _on_frames(self, frames: list[zmq.Frame]) -> tuple[Any, Any] | None:
        """Check one received message (I/O thread); return the inbox item, or None to drop it."""

    @abstractmethod
    def _write_layer(self, header: Any, payload: Any, st: Incoming) -> None:
        """Copy one layer into `st.dst_block_ids` (engine thread, in poll()); ValueError/OSError fail it."""

    def _forget(self, st: Incoming) -> None:
        """The request ended on this side: free what the transport holds for it (engine thread)."""

    def _housekeep(self, failed: list[tuple[str, str]]) -> None:
        """Every poll: e.g. fail requests whose sender is known to be gone (transports that can tell)."""

    def pool_address(self, layer: int) -> int:
        return self.kv_caches[layer].data_ptr()
