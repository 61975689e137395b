"""An expert worker's exchange socket and the thread that serves it: a ZeroMQ ROUTER bound to the worker's host
(port chosen by the pool, or by the OS), taking signed `DispatchRows` from any attention worker of the cluster and
answering each with its rows through the experts this worker owns.

One thread computes the exchanges in arrival order, so an attention worker's replies come back in the order it
sent (its micro-batches' outputs queue behind each other as the ping-pong expects). A frame that is unsigned,
forged, oversized or not a known message is dropped and logged: its sender learns nothing, not even a refusal.
A well-signed frame asking for something this worker does not hold (a layer without experts, a slot past its
own, a payload of the wrong length, a shared-memory slot it may not map or that is too small) gets
`ExchangeFailed`, which fails that exchange's step on the sender only.

Same-host attention workers send `DispatchShared` instead: the rows are in their owner-only slot, and the
outputs go back into it (`shared_rows.py`); the probe segment named in the welcome lets them find out. They send
it over a Unix socket of this user's (`local_channel.py`), which the same thread serves beside the ROUTER.

EPLB (`pool_balance.py`) asks over the ROUTER for the load this worker served (`LoadQuery`) and hands it a new
placement (`PlaceExperts`), which the shard loads on a thread of its own; this thread installs it between two
frames (`ExpertShard.settle`), and every answer says the newest placement held."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import zmq

from kvbaton.parallel.afd.frames import (
    WIRE_DTYPES,
    CombinedRows,
    CombinedShared,
    DispatchRows,
    DispatchShared,
    ExchangeFailed,
    FromExpert,
    LoadQuery,
    PlaceExperts,
    Placing,
    PoolHello,
    PoolLoad,
    PoolWelcome,
    ToExpert,
    max_frame_bytes,
)
from kvbaton.parallel.afd.local_channel import LocalListener, local_name
from kvbaton.parallel.afd.shard import ExpertShard, PlacementRefused
from kvbaton.parallel.afd.shared_rows import AttachedSegments, Probe, SlotLayout, shared_memory_usable, views
from kvbaton.wire import ChannelError, Codec, SignedCodec, curve_keys, curve_server

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
    shared: int = 0  # exchanges whose rows came through shared memory


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
                 max_rows: int = DEFAULT_MAX_ROWS, shared_memory: bool = True, encrypt: bool = False) -> None:
        self.shard = shard
        self.max_rows = max_rows
        self._row_bytes = shard.hidden * WIRE_DTYPES[shard.dtype_name]
        self._probe = Probe() if shared_memory and shared_memory_usable() else None
        self._attached = AttachedSegments()
        limit = max_frame_bytes(max_rows, shard.hidden, shard.dtype_name)
        self._codec = SignedCodec(secret, ToExpert, limit)
        self._replies = SignedCodec(secret, FromExpert, limit)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, limit)
        self._socket.setsockopt(zmq.LINGER, 0)
        curve_server(self._socket, curve_keys(secret, encrypt))  # rows in frames (other hosts) travel encrypted
        if port:  # the pool's choice: a replacement listens where the attention workers already connect
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._local = self._listen_locally() if self._probe is not None else None
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

    def _listen_locally(self) -> LocalListener | None:
        try:
            return LocalListener(local_name(self.address), ToExpert, FromExpert)
        except OSError as exc:  # the name is held (a predecessor not yet gone): same-host frames go over TCP
            logger.warning("expert exchange: no same-host socket (%s); frames go over %s", exc, self.address)
            return None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        local = self._local
        if local is not None:
            poller.register(local.listener, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self.shard.settle()
                for item, _ in poller.poll(POLL_MS):  # a plain socket comes back as its fd
                    if item is self._socket:
                        self._serve_one(self._socket.recv_multipart(copy=True))
                    elif local is not None and item == local.listener.fileno():
                        conn = local.accept()
                        if conn is not None:
                            poller.register(conn, zmq.POLLIN)
                    elif local is not None and item in local.connections:
                        self._serve_local(local, local.connections[item], poller)
        finally:
            self._socket.close(linger=0)
            if local is not None:
                local.close()

    def _serve_local(self, local: LocalListener, conn: socket.socket, poller: zmq.Poller) -> None:
        """One frame from a same-host attention worker: a shared-memory dispatch, answered on its socket. A
        closed connection, or one that does not read its answers, is dropped."""
        try:
            frame = conn.recv(local.requests.max_frame_bytes + 1)
        except BlockingIOError:
            return
        except OSError:
            frame = b""
        if not frame:
            self._hang_up(local, conn, poller)
            return
        began = time.perf_counter()
        try:
            msg = local.requests.decode(frame)
        except ChannelError as exc:
            self._refuse(len(frame), "same-host ", exc)
            return
        if not isinstance(msg, DispatchShared):
            self._refuse(len(frame), "same-host ", "only shared-memory dispatches go over the same-host socket")
            return
        try:
            conn.send(self._reply(msg, local.replies, len(frame), began))
        except OSError:  # its buffer is full (it does not read) or it is gone
            self._hang_up(local, conn, poller)

    @staticmethod
    def _hang_up(local: LocalListener, conn: socket.socket, poller: zmq.Poller) -> None:
        poller.unregister(conn)
        local.drop(conn)

    def _serve_one(self, parts: list[bytes]) -> None:
        if len(parts) != 2:  # [peer identity, frame]: anything else is not a DEALER of ours
            self.stats.refused_frames += 1
            return
        identity, frame = parts
        began = time.perf_counter()
        try:
            msg = self._codec.decode(frame)
        except ChannelError as exc:
            self._refuse(len(frame), "", exc)
            return
        self._socket.send_multipart([identity, self._reply(msg, self._replies, len(frame), began)], copy=False)

    def _refuse(self, frame_bytes: int, where: str, why: object) -> None:
        """A frame dropped unanswered: counted and logged, its sender told nothing."""
        self.stats.refused_frames += 1
        logger.warning("expert exchange: refused a %sframe (%d bytes): %s", where, frame_bytes, why)

    def _reply(self, msg: ToExpert, codec: Codec | SignedCodec, frame_bytes: int, began: float) -> bytes:
        """The encoded answer to `msg`, counted before it goes out (its reader then sees the counts)."""
        reply = self._answer(msg)
        out = codec.encode(reply)
        self._account(msg, reply, frame_bytes, len(out), began)
        return out

    def _account(self, msg: ToExpert, reply: FromExpert, frame_bytes: int, reply_bytes: int, began: float) -> None:
        """Count an answered frame. NOTE: a new stats object, swapped in whole: a reader on another thread (the
        worker's heartbeat) sees every counter of one moment, never an exchange counted but not its rows."""
        s = self.stats
        answered, shared = isinstance(reply, CombinedRows | CombinedShared), isinstance(reply, CombinedShared)
        rows = 0
        if answered and isinstance(msg, DispatchShared):
            rows = msg.rows
        elif answered and isinstance(msg, DispatchRows):
            rows = len(msg.slots) // 4
        payload_in, payload_out = (rows * (self._row_bytes + 4), rows * self._row_bytes) if shared else (0, 0)
        self.stats = dataclasses.replace(
            s, exchanges=s.exchanges + answered, rows=s.rows + rows, busy_s=s.busy_s + time.perf_counter() - began,
            shared=s.shared + shared, bytes_in=s.bytes_in + frame_bytes + payload_in,
            bytes_out=s.bytes_out + reply_bytes + payload_out)

    def _answer(self, msg: ToExpert) -> FromExpert:
        shard = self.shard
        if isinstance(msg, PoolHello):
            logger.info("expert exchange: attention worker %s connected", msg.attention)
            return self._welcome()
        if isinstance(msg, PlaceExperts):
            return self._place(msg)
        if isinstance(msg, LoadQuery):
            return PoolLoad(shard.counts.tolist(), shard.newest)
        try:
            if isinstance(msg, DispatchShared):
                rows, ids, outputs = self._check_shared(msg)
                outputs.copy_(shard.compute(msg.layer, rows, ids, msg.epoch))
                return CombinedShared(msg.ticket, shard.newest)
            rows, slots = self._check(msg)
            out = shard.compute(msg.layer, rows, slots, msg.epoch)
        except BadExchange as exc:
            return ExchangeFailed(msg.ticket, str(exc), shard.newest)
        except Exception as exc:  # a kernel's refusal: that step fails, the worker serves on
            logger.exception("expert exchange %d of layer %d failed", msg.ticket, msg.layer)
            return ExchangeFailed(msg.ticket, f"expert worker {shard.spec.rank}: {exc}", shard.newest)
        return CombinedRows(msg.ticket, bytes_of(out), shard.newest)

    def _welcome(self) -> PoolWelcome:
        shard, probe = self.shard, self._probe
        newest = shard.held[shard.newest]
        return PoolWelcome(rank=shard.spec.rank, size=shard.spec.size, epoch=shard.newest,
                           placement=newest.pool, layers=shard.moe_layers,
                           hidden=shard.hidden, dtype=shard.dtype_name, num_experts=shard.num_experts,
                           probe=probe.segment.name if probe else "", probe_token=probe.token if probe else b"",
                           local=self._local.name if self._local is not None else "")

    def _place(self, msg: PlaceExperts) -> Placing:
        known = self.shard.holds(msg.epoch) or msg.epoch in (self.shard.loading, self.shard.next_epoch)
        try:
            self.shard.place(msg.epoch, msg.placement)
        except PlacementRefused as exc:
            return Placing(msg.epoch, self.shard.newest, str(exc))
        if not known:
            logger.info("expert exchange: loading placement epoch %d", msg.epoch)
        return Placing(msg.epoch, self.shard.newest)

    def _check_layer(self, layer: int, epoch: int) -> None:
        shard = self.shard
        if layer not in shard.moe_layers:
            raise BadExchange(f"expert worker {shard.spec.rank} holds no experts of layer {layer}")
        if not shard.holds(epoch):
            shard.wait_loaded(epoch)  # a dispatch that overtook its placement's loading: it is served once loaded
        if not shard.holds(epoch):
            raise BadExchange(f"expert worker {shard.spec.rank} holds no placement epoch {epoch} "
                              f"(newest: {shard.newest})")

    def _check_slot_ids(self, slots: torch.Tensor) -> None:
        per = self.shard.slots_per_worker
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= per):
            raise BadExchange(f"slot ids must be in [0, {per})")

    def _check(self, msg: DispatchRows) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(msg.layer, msg.epoch)
        row_bytes = self._row_bytes
        n = len(msg.slots) // 4
        if len(msg.slots) % 4 or len(msg.rows) != n * row_bytes or n > self.max_rows:
            raise BadExchange(f"a dispatch of {len(msg.rows)} row bytes and {len(msg.slots)} slot bytes is not "
                              f"n rows of {row_bytes} bytes and their n int32 slots (n <= {self.max_rows})")
        slots = rows_of(msg.slots, torch.int32, 1).flatten().to(torch.int64)
        self._check_slot_ids(slots)
        return rows_of(msg.rows, self.shard.spec.dtype, self.shard.hidden), slots

    def _check_shared(self, msg: DispatchShared) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows, slot ids and output room of a shared-memory dispatch, once its slot checks out."""
        self._check_layer(msg.layer, msg.epoch)
        if self._probe is None:
            raise BadExchange("this expert worker takes no shared-memory exchanges")
        if not 0 <= msg.rows <= msg.capacity <= self.max_rows:
            raise BadExchange(f"a shared dispatch of {msg.rows} rows in a slot of {msg.capacity} is not "
                              f"0 <= rows <= capacity <= {self.max_rows}")
        layout = SlotLayout(msg.capacity, self._row_bytes)
        try:
            segment = self._attached.get(msg.segment)
        except (OSError, ValueError) as exc:
            raise BadExchange(f"cannot map shared slot {msg.segment[:80]!r}: {exc}") from exc
        if segment.size < layout.size:
            raise BadExchange(f"shared slot {msg.segment[:80]!r} holds {segment.size} bytes, a slot of "
                              f"{msg.capacity} rows needs {layout.size}")
        rows, ids, outputs = views(segment, layout, msg.rows, self.shard.spec.dtype, self.shard.hidden)
        ids = ids.to(torch.int64)  # a copy, checked: what the kernel indexes with cannot change under it
        self._check_slot_ids(ids)
        return rows, ids, outputs

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        elif not self._socket.closed:
            self._socket.close(linger=0)
            if self._local is not None:
                self._local.close()
        self._ctx.term()
        if not self._thread.is_alive():  # else it may still be reading a mapping
            self._attached.close()
        if self._probe is not None:
            self._probe.close()
