"""The redis transport's decode side: a reader thread takes notices and values out of the store,
checks them; poll() writes them into the pool."""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import redis as redis_py  # NOTE: redis-py (absolute import), not this package (kvbaton.kv.connectors.redis)
import torch

from kvbaton.kv.connectors.base import ConnectorConfig, KVReceiver, PollResult
from kvbaton.kv.connectors.bookkeeping import RequestMemory
from kvbaton.kv.connectors.redis import KEY_PREFIX, LayerStored, Notice, TransferAborted, client, codec, dst_digest
from kvbaton.kv.convert import write_blocks
from kvbaton.kv.layout import ELEMENT_BYTES, KVLayout
from kvbaton.kv.pools import KVPools

logger = logging.getLogger(__name__)

QUEUE_PREFIX = "kvbaton:kvq:"  # a receiver's notification list: QUEUE_PREFIX<worker>:<random>
POP_TIMEOUT_S = 0.2  # how long the reader blocks in BLPOP: bounds close() latency
MAX_POPS = 64  # notifications taken from the list per round trip


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
    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        super().__init__(config, pools)
        self.address = f"{QUEUE_PREFIX}{config.worker_name}:{secrets.token_hex(8)}"  # our notification list
        self._redis = client(config)
        self._codec = codec(config.secret)
        # [num_blocks, block_bytes] uint8 views of the pools (views share memory, any dtype)
        self._rows = [pools.blocks(layer).view(torch.uint8).numpy() for layer in range(self.layout.num_layers)]
        self._expected: dict[str, _Incoming] = {}
        self._memory: RequestMemory[_Arrival] = RequestMemory()  # arrived before expect(), or ended
        self._pending: list[_Arrival] = []  # early arrivals replayed by expect(), applied in poll()
        self._arrivals: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
        self._redis_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_loop, name=f"{config.worker_name}-kv-redis-recv",
                                        daemon=True)
        self._thread.start()

    def expect(self, request_id: str, dst_block_ids: list[int], deadline_s: float) -> None:
        self._expected[request_id] = _Incoming(np.asarray(dst_block_ids, dtype=np.int64), dst_digest(dst_block_ids),
                                               deadline_s, time.monotonic() + deadline_s)
        self._pending.extend(self._memory.expect(request_id))

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
        self._memory.prune(now)
        return PollResult(completed, failed)

    def cancel(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        self._memory.end(request_id)

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
        if inc is None:  # early (kept for expect()), or late (dropped)
            self._memory.hold(n.request_id, arrival)
            return
        if n.dst_digest != inc.dst_digest or inc.transfer_id not in (None, n.transfer_id):
            logger.warning("%s: dropped KV for %s of another transfer (a stale attempt, or other blocks)",
                           self.config.worker_name, n.request_id)
            return
        inc.transfer_id = n.transfer_id
        error, data = arrival.error, arrival.data
        if error is None and isinstance(n, LayerStored) and data is not None:
            if data.size == len(inc.dst_index) * self._sender_layout(n).block_bytes:
                self._store(n, data, inc, completed)
                return
            error = f"layer {n.layer} has {data.size} bytes, {len(inc.dst_index)} blocks expected"
        failed.append((n.request_id, error or "no data"))
        self._end(n.request_id)

    def _store(self, n: LayerStored, data: np.ndarray, inc: _Incoming, completed: list[str]) -> None:
        if n.layer in inc.received:
            return
        if n.kv_dtype != self.layout.dtype:
            write_blocks(self.pools, n.layer, inc.dst_index.tolist(), data.ctypes.data, range(len(inc.dst_index)),
                         self._sender_layout(n))
        elif len(inc.dst_index):
            self._rows[n.layer][inc.dst_index] = data.reshape(len(inc.dst_index), -1)
        inc.received.add(n.layer)
        if len(inc.received) == self.layout.num_layers:
            completed.append(n.request_id)
            self._end(n.request_id)

    def _end(self, request_id: str) -> None:
        del self._expected[request_id]
        self._memory.end(request_id)

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
        got = self._redis.blpop([self.address], timeout=POP_TIMEOUT_S)
        if got is None:
            return []
        return [got[1], *self._pop_more(MAX_POPS - 1)]  # type: ignore[list-item]  # bytes: no decode_responses

    def _pop_more(self, n: int) -> list[bytes]:
        """Up to `n` more notices, without waiting."""
        return list(self._redis.lpop(self.address, n) or [])  # type: ignore[arg-type]  # given a count: a list

    def _fetch(self, frames: list[bytes]) -> None:
        taken = self._take(frames)
        if any(value is None for n, value in taken if isinstance(n, LayerStored)):
            # An abort queues its notice, then deletes its layers: a layer found gone may be an abort's,
            # whose reason is then in the list already. Read on (once, bounded) to tell it apart from expiry.
            taken += self._take(self._pop_more(MAX_POPS))
        aborted = {n.transfer_id: n.reason for n, _ in taken if isinstance(n, TransferAborted)}
        for n, value in taken:
            if isinstance(n, TransferAborted):
                self._arrivals.put(_Arrival(n, None, f"the prefill side gave up: {n.reason}"))
            elif value is None and n.transfer_id in aborted:
                self._arrivals.put(_Arrival(n, None, f"the prefill side gave up: {aborted[n.transfer_id]}"))
            else:
                self._arrivals.put(self._check(n, value))

    def _take(self, frames: list[bytes]) -> list[tuple[Notice, bytes | None]]:
        """The plausible notices among `frames`, each stored layer's with its value (read and deleted)."""
        notices = [n for n in (self._codec.try_decode(f, f"{self.config.worker_name} redis KV") for f in frames)
                   if n is not None and self._plausible(n)]
        stored = [n for n in notices if isinstance(n, LayerStored)]
        pipe = self._redis.pipeline(transaction=False)
        for n in stored:
            pipe.getdel(n.key)  # read and delete at once: nothing lingers after its use
        values = iter(pipe.execute() if stored else [])  # in the order of `stored`
        return [(n, next(values) if isinstance(n, LayerStored) else None) for n in notices]

    def _plausible(self, n: Notice) -> bool:
        if isinstance(n, TransferAborted):
            return True
        ok = (0 <= n.layer < self.layout.num_layers and n.num_layers == self.layout.num_layers
              and n.kv_dtype in ELEMENT_BYTES and n.key.startswith(KEY_PREFIX)
              and n.nbytes % self._sender_layout(n).block_bytes == 0)
        if not ok:
            logger.warning("%s: refused a notice for %s (layer %d of %d, %d bytes, key %.60s)",
                           self.config.worker_name, n.request_id, n.layer, n.num_layers, n.nbytes, n.key)
        return ok

    def _sender_layout(self, n: LayerStored) -> KVLayout:
        """Ours in the sender's dtype (checked plausible first): its blocks, which write_blocks converts."""
        return self.layout if n.kv_dtype == self.layout.dtype else self.layout.with_dtype(n.kv_dtype)

    def _check(self, n: LayerStored, value: bytes | None) -> _Arrival:
        if value is None:
            return _Arrival(n, None, f"KV of layer {n.layer} is gone from redis (expired "
                            f"after {self.config.redis_ttl_s} s, or deleted)")
        if len(value) != n.nbytes or hashlib.sha256(value).digest() != n.sha256:
            logger.warning("%s: KV of %s layer %d fails its digest", self.config.worker_name, n.request_id, n.layer)
            return _Arrival(n, None, f"KV of layer {n.layer} fails its SHA-256 (tampered or "
                            "corrupted in redis); refused")
        return _Arrival(n, np.frombuffer(value, dtype=np.uint8))
