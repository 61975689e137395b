"""KV transfer with the Mooncake Transfer Engine: the receiver reads block rows straight out of
the sender's pool into its own, layer by layer, with batched one-sided reads.

    prefill (Sender)                               decode (Receiver)
    begin()      ── Offer(session, pool addrs, blocks) ──▶   checks layout and blocks
    save_layer(l)── LayerReady(l) ─────────────────────▶   poll(): batch_transfer_sync_read
                                                              sender pool rows -> own pool rows
    poll()       ◀── Done / Failed ─────────────────────   after the last layer (or on failure)

Both pools are registered with a Mooncake engine (`P2PHANDSHAKE` metadata: no etcd); control
messages are SignedCodec frames over ZeroMQ (DEALER -> ROUTER), one background thread per side.

NOTE: the receiver pulls, inside poll(), because that is the one way to honour both halves of
the contract with one-sided I/O: its pool is written only on the engine thread, and it never
receives data after it reported a request failed or cancelled (a pushing sender could still be
writing). The price is that poll() waits for the read — microseconds to milliseconds over RDMA,
~2 GB/s over loopback TCP, and at most Mooncake's transfer timeout for a hung peer. The sender
sends from its pool in place (zero copy): the contract keeps its source blocks allocated until
its poll() reports the transfer; a read must finish before the receiver's deadline, which is
set before the sender's (expect() precedes begin()), so a sender that gave up is never read.

Protocol: `KVBATON_MOONCAKE_PROTOCOL` = "tcp" (default) or "rdma" on a real cluster, with
`KVBATON_MOONCAKE_DEVICE` naming the RDMA NICs ("mlx5_0,mlx5_1"; empty: all). Mooncake's data
plane is unauthenticated (any peer that can reach its port may read or write registered
memory) and listens on every interface: use it only on a private cluster network.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from kvbaton.kv.connectors.base import ConnectorConfig, KVReceiver, KVSender, PollResult, TransferSpec
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from kvbaton.wire import SignedCodec

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "KVBATON_MOONCAKE_PROTOCOL"
DEVICE_ENV = "KVBATON_MOONCAKE_DEVICE"
PROTOCOLS = ("tcp", "rdma")
MAX_FRAME_BYTES = 16 * 2**20  # an Offer lists every block id twice
_SEGMENTS_PER_POLL = 1024  # ~0.05-0.1 s of small scattered reads over TCP here; far less over RDMA
_MAX_SEGMENTS = 1024  # entries per Mooncake batch call (its TCP lanes refuse ~2k queued per peer)


class Offer(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    session: str  # the sender's Mooncake engine, host:rpc_port
    layout: KVLayout
    num_blocks: int  # blocks in each of the sender's pools
    layer_addrs: list[int]  # base address of the sender's pool of each layer
    src_block_ids: list[int]
    dst_block_ids: list[int]


class LayerReady(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]
    layer: int


class Cancel(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    reason: str


class Done(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Failed(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    reason: str


ToReceiver = Offer | LayerReady | Cancel
ToSender = Done | Failed


def protocol() -> str:
    value = os.environ.get(PROTOCOL_ENV, "tcp")
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={value!r}: choose one of {', '.join(PROTOCOLS)}")
    return value


class _Engine:
    """A Mooncake engine with every layer's pool registered (remote peers may access only those)."""

    def __init__(self, host: str, kv_caches: list[torch.Tensor]) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines go to stderr per engine
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError("the mooncake KV transport needs `pip install kvbaton[mooncake]` "
                               "(and libibverbs1: apt-get install libibverbs1)") from exc
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol(), os.environ.get(DEVICE_ENV, "")) != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host} ({protocol()})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.addrs = [c.data_ptr() for c in kv_caches]
        if self.engine.batch_register_memory(self.addrs, [c.nbytes for c in kv_caches]) != 0:
            raise RuntimeError("Mooncake could not register the KV pools")

    def close(self) -> None:
        self.engine.batch_unregister_memory(self.addrs)
        del self.engine


class _Wire:
    """The ZeroMQ sockets of one side, all owned by one background thread. `send()` may be called
    from any thread; decoded messages come out of `inbox` as (peer, message)."""

    def __init__(self, name: str, codec: SignedCodec, bind_host: str | None = None) -> None:
        self.name, self._codec = name, codec
        self.inbox: queue.SimpleQueue[tuple[bytes, msgspec.Struct]] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        wake = f"inproc://kvbaton-mooncake-{id(self)}"
        self._pull = self._socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(wake)
        self._push = self._socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # unbounded: the engine thread never blocks on a send
        self._push.connect(wake)
        self._push_lock = threading.Lock()
        self._router = None
        if bind_host is not None:
            self._router = self._socket(zmq.ROUTER)
            self.address = f"tcp://{bind_host}:{self._router.bind_to_random_port(f'tcp://{bind_host}')}"
        self._dealers: dict[bytes, zmq.Socket] = {}  # receiver address -> socket (sender side)
        self._thread = threading.Thread(target=self._run, name=f"{name}-kv-mooncake", daemon=True)
        self._thread.start()

    def send(self, dest: bytes, msg: msgspec.Struct) -> None:
        """`dest`: a receiver address (sender side) or a peer identity from `inbox` (receiver side)."""
        with self._push_lock:
            self._push.send_multipart([dest, self._codec.encode(msg)])

    def close(self) -> None:
        with self._push_lock:
            self._push.send_multipart([b"", b""])
        self._thread.join(timeout=5.0)
        self._ctx.destroy(linger=0)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind in (zmq.ROUTER, zmq.DEALER):
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a stranger cannot make us buffer more
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._pull, self._router):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                parts = sock.recv_multipart()
                if sock is self._pull:
                    if not parts[0]:
                        return
                    try:
                        self._forward(poller, parts[0], parts[1])
                    except zmq.ZMQError as exc:  # bad address, or peer not reading: the transfer times out
                        logger.warning("%s: cannot send to %r: %s", self.name, parts[0][:100], exc)
                elif len(parts) == (2 if sock is self._router else 1):
                    peer = parts[0] if sock is self._router else sock.getsockopt(zmq.LAST_ENDPOINT)
                    msg = self._codec.try_decode(parts[-1], f"{self.name} mooncake control")
                    if msg is not None:
                        self.inbox.put((peer, msg))

    def _forward(self, poller: zmq.Poller, dest: bytes, frame: bytes) -> None:
        if self._router is not None:
            self._router.send_multipart([dest, frame])
            return
        sock = self._dealers.get(dest)
        if sock is None:
            sock = self._socket(zmq.DEALER)
            try:
                sock.connect(dest.decode(errors="replace"))
            except zmq.ZMQError:
                sock.close()
                raise
            self._dealers[dest] = sock
            poller.register(sock, zmq.POLLIN)
        sock.send(frame, zmq.NOBLOCK)  # a peer that stopped reading must not stall this thread


# ---- prefill side ----------------------------------------------------------------------------


@dataclass
class _Outgoing:
    spec: TransferSpec
    deadline: float


class Sender(KVSender):
    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self._engine = _Engine(config.host, kv_caches)
        self._wire = _Wire(config.worker_name, SignedCodec(config.secret, ToSender, MAX_FRAME_BYTES))
        self._num_blocks = kv_caches[0].shape[0] // layout.block_size
        self._transfers: dict[str, _Outgoing] = {}

    def begin(self, spec: TransferSpec) -> None:
        self.layout.check_compatible(spec.layout)
        if len(spec.src_block_ids) != len(spec.dst_block_ids):
            raise ValueError(f"{len(spec.src_block_ids)} source blocks for {len(spec.dst_block_ids)} destinations")
        if any(not 0 <= b < self._num_blocks for b in spec.src_block_ids):
            raise ValueError(f"source block id out of range [0, {self._num_blocks})")
        if spec.request_id in self._transfers:
            self._cancel(spec.request_id, "superseded by a new transfer of the same request")
        self._transfers[spec.request_id] = _Outgoing(spec, time.monotonic() + spec.deadline_s)
        offer = Offer(spec.request_id, self._engine.session, self.layout, self._num_blocks, self._engine.addrs,
                      list(spec.src_block_ids), list(spec.dst_block_ids))
        self._wire.send(spec.receiver.encode(), offer)

    def save_layer(self, layer: int, request_ids: list[str]) -> None:
        by_receiver: dict[str, list[str]] = {}
        for request_id in request_ids:
            t = self._transfers.get(request_id)
            if t is not None:
                by_receiver.setdefault(t.spec.receiver, []).append(request_id)
        for receiver, ids in by_receiver.items():
            self._wire.send(receiver.encode(), LayerReady(ids, layer))

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        while not self._wire.inbox.empty():
            _, msg = self._wire.inbox.get()
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
        self._wire.close()
        self._engine.close()

    def _cancel(self, request_id: str, reason: str) -> None:
        t = self._transfers.pop(request_id)
        self._wire.send(t.spec.receiver.encode(), Cancel(request_id, reason))


# ---- decode side -----------------------------------------------------------------------------


@dataclass
class _Incoming:
    dst_block_ids: list[int]
    deadline_s: float
    deadline: float
    peer: bytes | None = None
    offer: Offer | None = None
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (src block, dst block, count)
    ready: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Pairs of block ids as runs consecutive on both sides: fewer, larger reads."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class Receiver(KVReceiver):
    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self._engine = _Engine(config.host, kv_caches)
        self._wire = _Wire(config.worker_name, SignedCodec(config.secret, ToReceiver, MAX_FRAME_BYTES), config.host)
        self.address = self._wire.address
        self._num_blocks = kv_caches[0].shape[0] // layout.block_size
        self._expected: dict[str, _Incoming] = {}
        self._early: dict[str, tuple[float, list[tuple[bytes, msgspec.Struct]]]] = {}  # before expect()
        self._ended: dict[str, float] = {}  # cancelled, failed or done: late messages are dropped

    def expect(self, request_id: str, dst_block_ids: list[int], deadline_s: float) -> None:
        self._ended.pop(request_id, None)
        self._expected[request_id] = _Incoming(list(dst_block_ids), deadline_s, time.monotonic() + deadline_s)

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        for request_id in [r for r in self._early if r in self._expected]:
            for peer, msg in self._early.pop(request_id)[1]:
                self._route(peer, msg, request_id, failed)
        while not self._wire.inbox.empty():
            peer, msg = self._wire.inbox.get()
            for request_id in msg.request_ids if isinstance(msg, LayerReady) else [msg.request_id]:
                self._route(peer, msg, request_id, failed)
        now = time.monotonic()
        for request_id, inc in list(self._expected.items()):
            if now > inc.deadline:
                self._fail(request_id, f"no complete KV within {inc.deadline_s:.1f} s ({len(inc.done)}/"
                                       f"{self.layout.num_layers} layers read)", failed)
        self._read_ready(completed, failed)
        self._prune(now)
        return PollResult(completed, failed)

    def cancel(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        self._early.pop(request_id, None)
        self._ended[request_id] = time.monotonic()

    def close(self) -> None:
        self._wire.close()
        self._engine.close()

    def _route(self, peer: bytes, msg: msgspec.Struct, request_id: str, failed: list[tuple[str, str]]) -> None:
        inc = self._expected.get(request_id)
        if inc is None and request_id in self._ended:
            if isinstance(msg, Offer):  # spare the sender its deadline
                self._wire.send(peer, Failed(request_id, "the decode worker is not expecting this request "
                                                         "(cancelled, failed or already done)"))
        elif inc is None:
            self._early.setdefault(request_id, (time.monotonic(), []))[1].append((peer, msg))
        elif isinstance(msg, Offer):
            problem = self._check_offer(msg, inc)
            inc.peer = peer
            if problem:
                self._fail(request_id, problem, failed)
            else:
                inc.offer, inc.runs = msg, contiguous_runs(msg.src_block_ids, msg.dst_block_ids)
        elif isinstance(msg, LayerReady):
            if 0 <= msg.layer < self.layout.num_layers:
                inc.ready.add(msg.layer)
        else:
            self._end(request_id)
            failed.append((request_id, f"sender cancelled: {msg.reason}"))

    def _check_offer(self, offer: Offer, inc: _Incoming) -> str | None:
        try:
            self.layout.check_compatible(offer.layout)
        except KVLayoutMismatch as exc:
            return str(exc)
        if offer.dst_block_ids != inc.dst_block_ids or len(offer.src_block_ids) != len(inc.dst_block_ids):
            return "the sender's destination blocks differ from the ones this receiver reserved"
        if len(offer.layer_addrs) != self.layout.num_layers:
            return f"offer names {len(offer.layer_addrs)} layer pools, {self.layout.num_layers} expected"
        if any(not 0 <= b < offer.num_blocks for b in offer.src_block_ids):
            return "offer names source blocks outside the sender's pool"
        if any(not 0 <= b < self._num_blocks for b in offer.dst_block_ids):
            return "offer names destination blocks outside this pool"
        return None

    def _read_ready(self, completed: list[str], failed: list[tuple[str, str]]) -> None:
        """Read announced, unread layers, oldest request first, up to a budget of segments (so one
        poll stalls the engine loop for a bounded time); one batch per sender engine."""
        by_session: dict[str, list[tuple[str, list[int]]]] = {}
        budget = _SEGMENTS_PER_POLL
        for request_id, inc in self._expected.items():
            if inc.offer is None or budget <= 0:
                continue
            layers = sorted(inc.ready - inc.done)[:max(1, budget // max(1, len(inc.runs)))]
            if layers:
                budget -= len(layers) * len(inc.runs)
                by_session.setdefault(inc.offer.session, []).append((request_id, layers))
        for session, jobs in by_session.items():
            if self._read(session, jobs):
                continue
            for job in jobs:  # one bad offer must not sink the others: retry each request alone
                if len(jobs) == 1 or not self._read(session, [job]):
                    self._fail(job[0], f"Mooncake read of layers {job[1]} from {session} failed", failed)
        for request_id, inc in list(self._expected.items()):
            if len(inc.done) == self.layout.num_layers:
                if time.monotonic() > inc.deadline:  # the sender may have given up and freed its blocks
                    self._fail(request_id, "KV read finished after the deadline", failed)
                    continue
                self._end(request_id)
                completed.append(request_id)
                self._wire.send(inc.peer, Done(request_id))

    def _read(self, session: str, jobs: list[tuple[str, list[int]]]) -> bool:
        bb = self.layout.block_bytes
        local, remote, lengths = [], [], []
        for request_id, layers in jobs:
            inc = self._expected[request_id]
            for layer in layers:
                for s, d, n in inc.runs:
                    local.append(self._engine.addrs[layer] + d * bb)
                    remote.append(inc.offer.layer_addrs[layer] + s * bb)
                    lengths.append(n * bb)
        for i in range(0, len(local), _MAX_SEGMENTS):
            chunk = slice(i, i + _MAX_SEGMENTS)
            if self._engine.engine.batch_transfer_sync_read(session, local[chunk], remote[chunk], lengths[chunk]):
                return False
        for request_id, layers in jobs:
            self._expected[request_id].done.update(layers)
        return True

    def _end(self, request_id: str) -> _Incoming:
        self._ended[request_id] = time.monotonic()
        return self._expected.pop(request_id)

    def _fail(self, request_id: str, reason: str, failed: list[tuple[str, str]]) -> None:
        inc = self._end(request_id)
        failed.append((request_id, reason))
        if inc.peer is not None:
            self._wire.send(inc.peer, Failed(request_id, reason))

    def _prune(self, now: float) -> None:
        horizon = now - 60.0  # a sender's messages for a request this receiver never expects
        for request_id in [r for r, (t, _) in self._early.items() if t < horizon]:
            del self._early[request_id]
        for request_id in [r for r, t in self._ended.items() if t < horizon]:
            del self._ended[request_id]
