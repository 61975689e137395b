"""KV transfer through a shared Redis store: the sender parks each (request, layer) in a key, the
receiver takes it out.

    prefill                         redis                                   decode
    save_layer(l) -> copy rows ──▶  SET kvbaton:kv:<req>:<xfer>:<l> EX ttl
      (writer thread)               RPUSH <receiver list> signed LayerStored(key, sha256)
                                                          BLPOP (reader thread) ◀──
                                                          GETDEL key, check sha256
                                                          poll(): rows -> pool[dst]

The sender is done once every layer is in the store (the store holds the data; the prefill
worker may free its blocks). Every key, the notification list included, carries a TTL of
`redis_ttl_s`, so nothing outlives an abandoned transfer; the receiver deletes what it reads.
Notifications are SignedCodec frames and carry the data's SHA-256, so a forged notification
or a tampered value is refused — Redis itself is not trusted with integrity.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import redis as redis_py  # NOTE: absolute import of redis-py, not this module (kvbaton.kv.connectors.redis)
import torch
from redis.connection import Encoder, PythonRespSerializer

from kvbaton.kv.connectors.base import ConnectorConfig, KVReceiver, KVSender, PollResult, TransferSpec
from kvbaton.kv.layout import KVLayout, block_view
from kvbaton.wire import SignedCodec

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvbaton:kv:"
QUEUE_PREFIX = "kvbaton:kvq:"
MAX_NOTICE_BYTES = 64 * 1024
_POP_TIMEOUT_S = 0.2  # how long the reader blocks in BLPOP: bounds close() latency
_MAX_BATCH = 64  # notifications (or writes) handled per round trip


class LayerStored(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    transfer_id: str  # fresh per begin(): a receiver takes layers of one transfer only
    dst_digest: bytes  # names the destination blocks: data meant for other blocks is refused
    layer: int
    num_layers: int
    key: str
    nbytes: int
    sha256: bytes


class TransferAborted(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    transfer_id: str
    dst_digest: bytes
    reason: str


Notice = LayerStored | TransferAborted


def _client(config: ConnectorConfig) -> redis_py.Redis:
    if not config.redis_url:
        raise ValueError("the redis KV transport needs a redis_url (kvbaton serve starts a private redis-server "
                         "when --redis-url is not given)")
    # NOTE: socket_timeout must exceed the BLPOP timeout, or an idle BLPOP reads as a dead server.
    # redis-py's pure-Python command packer sends large values as they are, where the hiredis
    # one copies them first: 2-4x faster SETs of KV layers here (replies still parse with hiredis).
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis_py.Redis.from_url(config.redis_url, socket_connect_timeout=5.0, socket_timeout=30.0,
                                   command_packer=packer)


def data_key(request_id: str, transfer_id: str, layer: int) -> str:
    return f"{KEY_PREFIX}{request_id}:{transfer_id}:{layer}"


def dst_digest(block_ids: list[int]) -> bytes:
    return hashlib.blake2b(np.asarray(block_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


# ---- prefill side ----------------------------------------------------------------------------


@dataclass
class _Outgoing:
    spec: TransferSpec
    transfer_id: str
    dst_digest: bytes
    src_index: torch.Tensor  # [n] long: rows of block_view(pool)
    deadline: float
    stored: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Write:
    request_id: str
    transfer_id: str
    dst_digest: bytes
    receiver: str
    layer: int
    rows: torch.Tensor  # [n, block_numel], a copy taken in save_layer


@dataclass(frozen=True)
class _Cleanup:
    request_id: str
    transfer_id: str
    dst_digest: bytes
    receiver: str
    num_layers: int
    reason: str


class Sender(KVSender):
    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self._redis = _client(config)
        self._codec = SignedCodec(config.secret, Notice, MAX_NOTICE_BYTES)
        self._transfers: dict[str, _Outgoing] = {}  # engine thread only
        self._work: queue.SimpleQueue[_Write | _Cleanup | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[str, str, int, str | None]] = queue.SimpleQueue()
        self._dropped: set[str] = set()  # transfer ids the writer must skip (set by the engine thread)
        self._thread = threading.Thread(target=self._write_loop, name=f"{config.worker_name}-kv-redis-send",
                                        daemon=True)
        self._thread.start()

    def begin(self, spec: TransferSpec) -> None:
        self.layout.check_compatible(spec.layout)
        num_blocks = self.kv_caches[0].shape[0] // self.layout.block_size
        if len(spec.src_block_ids) != len(spec.dst_block_ids):
            raise ValueError(f"{len(spec.src_block_ids)} source blocks for {len(spec.dst_block_ids)} destinations")
        if any(not 0 <= b < num_blocks for b in spec.src_block_ids):
            raise ValueError(f"source block id out of range [0, {num_blocks})")
        if spec.request_id in self._transfers:
            self._drop(spec.request_id, "superseded by a new transfer of the same request")
        src_index = torch.tensor(spec.src_block_ids, dtype=torch.long)
        self._transfers[spec.request_id] = _Outgoing(spec, secrets.token_hex(8), dst_digest(spec.dst_block_ids),
                                                     src_index, time.monotonic() + spec.deadline_s)

    def save_layer(self, layer: int, request_ids: list[str]) -> None:
        pool = block_view(self.kv_caches[layer], self.layout)  # [num_blocks, block_numel]
        for request_id in request_ids:
            t = self._transfers.get(request_id)
            if t is not None and layer not in t.stored:
                # NOTE: index_select copies, so the writer never reads the live pool
                rows = pool.index_select(0, t.src_index)
                self._work.put(_Write(request_id, t.transfer_id, t.dst_digest, t.spec.receiver, layer, rows))

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        while not self._results.empty():
            request_id, transfer_id, layer, error = self._results.get()
            t = self._transfers.get(request_id)
            if t is None or t.transfer_id != transfer_id:
                continue
            if error is not None:
                failed.append((request_id, f"redis write of layer {layer} failed: {error}"))
                self._drop(request_id, "the prefill side failed to store the KV")
                continue
            t.stored.add(layer)
            if len(t.stored) == self.layout.num_layers:
                completed.append(request_id)
                del self._transfers[request_id]
        now = time.monotonic()
        for request_id, t in list(self._transfers.items()):
            if now > t.deadline:
                failed.append((request_id, f"deadline of {t.spec.deadline_s:.1f} s passed with {len(t.stored)}/"
                                           f"{self.layout.num_layers} layers stored in redis"))
                self._drop(request_id, "deadline passed on the prefill side")
        return PollResult(completed, failed)

    def abort(self, request_id: str) -> None:
        if request_id in self._transfers:
            self._drop(request_id, "aborted by the prefill worker")

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=10.0)
        self._redis.close()

    def _drop(self, request_id: str, reason: str) -> None:
        """Forget a transfer; the writer skips its queued layers, deletes stored ones, tells the receiver."""
        t = self._transfers.pop(request_id)
        self._dropped.add(t.transfer_id)
        self._work.put(_Cleanup(request_id, t.transfer_id, t.dst_digest, t.spec.receiver, self.layout.num_layers,
                                reason))

    # ---- writer thread ----

    def _write_loop(self) -> None:
        while True:
            batch = [self._work.get()]
            while len(batch) < _MAX_BATCH and batch[-1] is not None and not self._work.empty():
                batch.append(self._work.get())
            items = [item for item in batch if item is not None]
            if items:
                self._write_batch(items)
            if batch[-1] is None:
                return

    def _write_batch(self, items: list[_Write | _Cleanup]) -> None:
        ttl = self.config.redis_ttl_s
        pipe = self._redis.pipeline(transaction=False)
        writes = []
        for item in items:
            if isinstance(item, _Cleanup):
                self._dropped.discard(item.transfer_id)  # FIFO: no write of it is left behind this
                pipe.delete(*[data_key(item.request_id, item.transfer_id, layer) for layer in range(item.num_layers)])
                notice: Notice = TransferAborted(item.request_id, item.transfer_id, item.dst_digest, item.reason)
            elif item.transfer_id in self._dropped:
                continue
            else:
                data = item.rows.view(torch.uint8).numpy().reshape(-1)  # [n * block_bytes]: len() is bytes
                key = data_key(item.request_id, item.transfer_id, item.layer)
                notice = LayerStored(item.request_id, item.transfer_id, item.dst_digest, item.layer,
                                     self.layout.num_layers, key, data.nbytes, hashlib.sha256(data).digest())
                pipe.set(key, memoryview(data), ex=ttl)
                writes.append(item)
            pipe.rpush(item.receiver, self._codec.encode(notice))
            pipe.expire(item.receiver, ttl)  # an abandoned receiver's list goes too
        error = None
        try:
            pipe.execute()
        except Exception as exc:  # any failure must reach poll(), not kill this thread
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: redis write failed: %s", self.config.worker_name, error)
        for item in writes:
            self._results.put((item.request_id, item.transfer_id, item.layer, error))


# ---- decode side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Arrival:
    notice: Notice
    data: np.ndarray | None  # [nbytes] uint8, checked against its digest
    error: str | None = None


@dataclass
class _Incoming:
    dst_index: np.ndarray  # [n] int64
    dst_digest: bytes
    deadline_s: float
    deadline: float
    transfer_id: str | None = None  # of the first layer taken
    received: set[int] = field(default_factory=set)


class Receiver(KVReceiver):
    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self.address = f"{QUEUE_PREFIX}{config.worker_name}:{secrets.token_hex(8)}"  # our notification list
        self._redis = _client(config)
        self._codec = SignedCodec(config.secret, Notice, MAX_NOTICE_BYTES)
        # [num_blocks, block_bytes] uint8 views of the pools (views share memory, any dtype)
        self._pools = [block_view(c, layout).view(torch.uint8).numpy() for c in kv_caches]
        self._expected: dict[str, _Incoming] = {}
        self._early: dict[str, tuple[float, list[_Arrival]]] = {}  # arrived before expect()
        self._ended: dict[str, float] = {}  # cancelled, failed or done: late data is dropped
        self._pending: list[_Arrival] = []  # early arrivals replayed by expect(), applied in poll()
        self._arrivals: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
        self._redis_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_loop, name=f"{config.worker_name}-kv-redis-recv",
                                        daemon=True)
        self._thread.start()

    def expect(self, request_id: str, dst_block_ids: list[int], deadline_s: float) -> None:
        self._ended.pop(request_id, None)
        self._expected[request_id] = _Incoming(np.asarray(dst_block_ids, dtype=np.int64), dst_digest(dst_block_ids),
                                               deadline_s, time.monotonic() + deadline_s)
        _, early = self._early.pop(request_id, (0.0, []))
        self._pending.extend(early)

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        arrivals, self._pending = self._pending, []
        while not self._arrivals.empty():
            arrivals.append(self._arrivals.get())
        for arrival in arrivals:
            self._apply(arrival, completed, failed)
        now = time.monotonic()
        for request_id, inc in list(self._expected.items()):
            if now > inc.deadline:
                reason = (f"no complete KV within {inc.deadline_s:.1f} s ({len(inc.received)}/"
                          f"{self.layout.num_layers} layers arrived)")
                if self._redis_error:
                    reason += f"; redis: {self._redis_error}"
                failed.append((request_id, reason))
                self._end(request_id)
        self._prune(now)
        return PollResult(completed, failed)

    def cancel(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        self._early.pop(request_id, None)
        self._ended[request_id] = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        try:
            self._redis.delete(self.address)
        except redis_py.RedisError:
            pass  # it expires anyway
        self._redis.close()

    def _apply(self, arrival: _Arrival, completed: list[str], failed: list[tuple[str, str]]) -> None:
        n = arrival.notice
        inc = self._expected.get(n.request_id)
        if inc is None:
            if n.request_id not in self._ended:
                self._early.setdefault(n.request_id, (time.monotonic(), []))[1].append(arrival)
            return
        if n.dst_digest != inc.dst_digest or inc.transfer_id not in (None, n.transfer_id):
            logger.warning("%s: dropped KV for %s of another transfer (a stale attempt, or other blocks)",
                           self.config.worker_name, n.request_id)
            return
        inc.transfer_id = n.transfer_id
        error = arrival.error
        if error is None and arrival.data.size != len(inc.dst_index) * self.layout.block_bytes:
            error = f"layer {n.layer} has {arrival.data.size} bytes, {len(inc.dst_index)} blocks expected"
        if error is not None:
            failed.append((n.request_id, error))
            self._end(n.request_id)
        elif n.layer not in inc.received:
            if len(inc.dst_index):
                self._pools[n.layer][inc.dst_index] = arrival.data.reshape(len(inc.dst_index), -1)
            inc.received.add(n.layer)
            if len(inc.received) == self.layout.num_layers:
                completed.append(n.request_id)
                self._end(n.request_id)

    def _end(self, request_id: str) -> None:
        del self._expected[request_id]
        self._ended[request_id] = time.monotonic()

    def _prune(self, now: float) -> None:
        horizon = now - self.config.redis_ttl_s  # the store forgets by then too
        for request_id in [r for r, (t, _) in self._early.items() if t < horizon]:
            del self._early[request_id]
        for request_id in [r for r, t in self._ended.items() if t < horizon]:
            del self._ended[request_id]

    # ---- reader thread ----

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._pop_frames()
                if frames:
                    self._fetch(frames)
                self._redis_error = None
            except Exception as exc:  # redis down (or a bug): log, back off, keep serving
                if self._redis_error is None:
                    logger.warning("%s: redis KV reader: %s", self.config.worker_name, exc)
                self._redis_error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(0.5)

    def _pop_frames(self) -> list[bytes]:
        got = self._redis.blpop([self.address], timeout=_POP_TIMEOUT_S)
        if got is None:
            return []
        return [got[1], *(self._redis.lpop(self.address, _MAX_BATCH - 1) or [])]

    def _fetch(self, frames: list[bytes]) -> None:
        notices = [n for n in (self._codec.try_decode(f, f"{self.config.worker_name} redis KV") for f in frames)
                   if n is not None and self._plausible(n)]
        stored = [n for n in notices if isinstance(n, LayerStored)]
        pipe = self._redis.pipeline(transaction=False)
        for n in stored:
            pipe.getdel(n.key)  # read and delete at once: nothing lingers after its use
        values = iter(pipe.execute() if stored else [])  # in the order of `stored`
        for n in notices:
            if isinstance(n, TransferAborted):
                self._arrivals.put(_Arrival(n, None, f"the prefill side gave up: {n.reason}"))
            else:
                self._arrivals.put(self._check(n, next(values)))

    def _plausible(self, n: Notice) -> bool:
        if isinstance(n, TransferAborted):
            return True
        ok = (0 <= n.layer < self.layout.num_layers and n.num_layers == self.layout.num_layers
              and n.key.startswith(KEY_PREFIX) and n.nbytes % self.layout.block_bytes == 0)
        if not ok:
            logger.warning("%s: refused a notice for %s (layer %d of %d, %d bytes, key %.60s)",
                           self.config.worker_name, n.request_id, n.layer, n.num_layers, n.nbytes, n.key)
        return ok

    def _check(self, n: LayerStored, value: bytes | None) -> _Arrival:
        if value is None:
            return _Arrival(n, None, f"KV of layer {n.layer} is gone from redis (expired "
                            f"after {self.config.redis_ttl_s} s, or deleted)")
        if len(value) != n.nbytes or hashlib.sha256(value).digest() != n.sha256:
            logger.warning("%s: KV of %s layer %d fails its digest", self.config.worker_name, n.request_id, n.layer)
            return _Arrival(n, None, f"KV of layer {n.layer} fails its SHA-256 (tampered or "
                            "corrupted in redis); refused")
        return _Arrival(n, np.frombuffer(value, dtype=np.uint8))
