"""The decode side of the ZeroMQ transports: what is expected, deadlines, acks, nacks, refusals."""

from __future__ import annotations

import collections
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvbaton.kv.connectors.base import ConnectorConfig, KVReceiver, PollResult
from kvbaton.kv.connectors.bookkeeping import RequestMemory
from kvbaton.kv.connectors.zmq_control import NOT_EXPECTING, Ack, SenderFailed
from kvbaton.kv.pools import KVPools
from kvbaton.kv.rows import rows_within
from kvbaton.wire import IOThread, SignedCodec, curve_keys


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

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        super().__init__(config, pools)
        self.num_blocks = pools.num_blocks
        self.codec = SignedCodec(config.secret, self.decode_type, self.max_header_bytes())
        self._expected: dict[str, Incoming] = {}
        self._inbox: collections.deque[tuple[Any, Any]] = collections.deque()
        self._nacked: RequestMemory[None] = RequestMemory()  # ended here: answered "not expecting"
        self.io = IOThread(f"kv-{config.transport}-receiver", curve_keys(config.secret, config.encrypt_traffic))
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
        self._nacked.expect(request_id)
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
        self._nacked.prune(now)
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
            header.layout.check_transferable(self.layout)
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
        if self._nacked.has_ended(request_id):  # one nack per request, not one per layer
            return
        self._nacked.end(request_id)
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
