"""An expert worker's exchange socket and the thread that serves it: a ZeroMQ ROUTER bound to the worker's host
(port chosen by the pool, or by the OS), taking signed `DispatchRows` from any attention worker of the cluster and
answering each with its rows through the experts this worker owns.

One thread computes the exchanges in arrival order, so an attention worker's replies come back in the order it
sent (its micro-batches' outputs queue behind each other as the ping-pong expects). A frame that is unsigned,
forged, oversized or not a known message is dropped and logged: its sender learns nothing, not even a refusal.
A well-signed frame asking for something this worker does not hold (a layer without experts, a slot past its
own, a payload of the wrong length) gets `ExchangeFailed`, which fails that exchange's step on the sender only."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import zmq

from kvbaton.parallel.afd.frames import (
    WIRE_DTYPES,
    CombinedRows,
    DispatchRows,
    ExchangeFailed,
    FromExpert,
    PoolHello,
    PoolWelcome,
    ToExpert,
    max_frame_bytes,
)
from kvbaton.parallel.afd.shard import ExpertShard
from kvbaton.wire import ChannelError, SignedCodec

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the serving thread looks whether it should stop
DEFAULT_MAX_ROWS = 65536  # rows one exchange may carry (token-expert pairs of one layer's micro-batch)


class BadExchange(ValueError):
    """A signed dispatch this worker cannot serve; the sender's step fails with the message."""


@dataclass
class ServerStats:
    exchanges: int = 0
    rows: int = 0
    busy_s: float = 0.0  # decoding, computing and answering exchanges
    bytes_in: int = 0
    bytes_out: int = 0
    refused_frames: int = 0


def rows_of(payload: bytes, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A frame's row payload as an [n, width] tensor over its bytes (read-only: the kernels only read it)."""
    with warnings.catch_warnings():  # torch warns that the buffer is not writable; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=dtype) if payload else torch.empty(0, dtype=dtype)
    return flat.view(-1, width)


def bytes_of(rows: torch.Tensor) -> bytes:
    """A tensor's bytes for a frame's payload field, without a copy (msgspec encodes any buffer as bytes)."""
    return memoryview(rows.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[return-value,arg-type]


class ExpertServer:
    def __init__(self, shard: ExpertShard, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.shard = shard
        self.max_rows = max_rows
        limit = max_frame_bytes(max_rows, shard.hidden, shard.dtype_name)
        self._codec = SignedCodec(secret, ToExpert, limit)
        self._replies = SignedCodec(secret, FromExpert, limit)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, limit)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:  # the pool's choice: a replacement listens where the attention workers already connect
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.stats = ServerStats()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvbaton-expert-exchange", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def serving(self) -> bool:
        """Its thread is up (False once it stopped, or died on an error)."""
        return self._thread.is_alive()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_MS):
                    self._serve_one(self._socket.recv_multipart(copy=True))
        finally:
            self._socket.close(linger=0)

    def _serve_one(self, parts: list[bytes]) -> None:
        if len(parts) != 2:  # [peer identity, frame]: anything else is not a DEALER of ours
            self.stats.refused_frames += 1
            return
        identity, frame = parts
        began = time.perf_counter()
        try:
            msg = self._codec.decode(frame)
        except ChannelError as exc:
            self.stats.refused_frames += 1
            logger.warning("expert exchange: refused a frame (%d bytes): %s", len(frame), exc)
            return
        reply = self._answer(msg)
        out = self._replies.encode(reply)
        self._socket.send_multipart([identity, out], copy=False)
        self.stats.busy_s += time.perf_counter() - began
        self.stats.bytes_in += len(frame)
        self.stats.bytes_out += len(out)

    def _answer(self, msg: ToExpert) -> FromExpert:
        shard = self.shard
        if isinstance(msg, PoolHello):
            logger.info("expert exchange: attention worker %s connected", msg.attention)
            return PoolWelcome(rank=shard.spec.rank, size=shard.spec.size, slots=list(shard.slots),
                               layers=sorted(shard.layers), hidden=shard.hidden, dtype=shard.dtype_name,
                               num_experts=shard.num_experts)
        try:
            rows, slots = self._check(msg)
            out = shard.compute(msg.layer, rows, slots)
        except BadExchange as exc:
            return ExchangeFailed(msg.ticket, str(exc))
        except Exception as exc:  # a kernel's refusal: that step fails, the worker serves on
            logger.exception("expert exchange %d of layer %d failed", msg.ticket, msg.layer)
            return ExchangeFailed(msg.ticket, f"expert worker {shard.spec.rank}: {exc}")
        self.stats.exchanges += 1
        self.stats.rows += rows.shape[0]
        return CombinedRows(msg.ticket, bytes_of(out))

    def _check(self, msg: DispatchRows) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.shard
        if msg.layer not in shard.layers:
            raise BadExchange(f"expert worker {shard.spec.rank} holds no experts of layer {msg.layer}")
        row_bytes = shard.hidden * WIRE_DTYPES[shard.dtype_name]
        n = len(msg.slots) // 4
        if len(msg.slots) % 4 or len(msg.rows) != n * row_bytes or n > self.max_rows:
            raise BadExchange(f"a dispatch of {len(msg.rows)} row bytes and {len(msg.slots)} slot bytes is not "
                              f"n rows of {row_bytes} bytes and their n int32 slots (n <= {self.max_rows})")
        slots = rows_of(msg.slots, torch.int32, 1).flatten().to(torch.int64)
        if n and (int(slots.min()) < 0 or int(slots.max()) >= len(shard.slots)):
            raise BadExchange(f"slot ids must be in [0, {len(shard.slots)})")
        return rows_of(msg.rows, shard.spec.dtype, shard.hidden), slots

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        elif not self._socket.closed:
            self._socket.close(linger=0)
        self._ctx.term()
