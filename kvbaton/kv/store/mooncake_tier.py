"""L4 on a Mooncake Store: blocks as objects in a cluster-wide memory pool (Mooncake's master places them in
the segments its clients mount; `mooncake_store.py` runs a private one whose own process holds the memory).

    object "kvb:<key hex>" = expiry (8, fp64 unix time) | record (`records.py`: MAC, key, length, payload)

- Anyone who reaches the store may write it: a record that does not verify under `record_key` (forged, or
  another cluster secret's) is a miss, counted corrupt, and removed. The expiry is outside the MAC: rewriting
  it can keep a genuine block alive longer, never change what it holds.
- Capacity and eviction are the store's: its master evicts (approximately LRU) past its high watermark.
- TTL: Mooncake leases protect an object from eviction rather than expire it, so the expiry travels in the
  object; an expired block reads as a miss and is removed.
- A failing store (master gone, client error) costs a miss and opens a circuit breaker, like the redis tier:
  no exception leaves the tier. The breaker stays open RETRY_AFTER_S after a first failure and twice as long
  after each failure in a row (up to MAX_RETRY_AFTER_S), so a store that stays dead costs the engine rarer and
  rarer waits. Puts are synchronous (~0.4 ms for a 360 KiB block here).
- NOTE: the client's calls to a dead master block ~4 s each (its RPC timeout, not settable from Python), so
  every call runs on the tier's own thread and is given up after CALL_TIMEOUT_S: the engine waits that long
  once, then the breaker skips the tier; a call still stuck makes the next ones fail at once.
- NOTE: CALL_TIMEOUT_S tells a dead store from a slow host, not from a slow call: a client's first put or get
  opens its connection to the segment holding the block, and beside two busy cores that took 0.4-0.6 s here
  (a 0.5 s timeout opened the breaker on a healthy store and lost the prefix).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as CallTimeout
from typing import Any, TypeVar

from kvbaton.kv.store.base import KVTier, PayloadFiller, PayloadSink, TierStats
from kvbaton.kv.store.keys import key_text
from kvbaton.kv.store.records import HEADER_BYTES, CorruptRecord, RecordKey, payload_of, write_header

logger = logging.getLogger(__name__)

PREFIX = "kvb:"
RETRY_AFTER_S = 2.0
MAX_RETRY_AFTER_S = 32.0
CALL_TIMEOUT_S = 2.0  # a normal call takes ~1 ms, a first contact under load up to ~0.6 s; a dead master 4 s
T = TypeVar("T")
_EXPIRY = struct.Struct("<d")
TRANSFER_BUFFER_BYTES = 64 * 2**20  # the client's local buffer, staging a get or put (a few blocks at once)


class MooncakeTier(KVTier):
    name = "mooncake"

    def __init__(self, master: str, metadata_url: str, payload_bytes: int, ttl_s: float, *, record_key: RecordKey,
                 host: str = "127.0.0.1", capacity_bytes: int = 0) -> None:
        super().__init__(payload_bytes)
        from mooncake.store import MooncakeDistributedStore

        self.ttl_s = ttl_s
        self._record_key = record_key
        self._record_bytes = _EXPIRY.size + HEADER_BYTES + payload_bytes
        self._lock = threading.Lock()  # _stats and the breaker
        self._stats = TierStats(self.name, capacity_bytes, shared=True)
        self._down_until = 0.0
        self._failures_in_a_row = 0
        self._caller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvb-mooncake-tier")
        self._pending: Any = None  # the last call's future: one still running means the store is stuck
        self._call_lock = threading.Lock()
        self._client = MooncakeDistributedStore()
        # NOTE: a global segment of 0: the blocks live in the store's own process, not in this worker's memory
        rc = self._client.setup(host, metadata_url, 0, max(TRANSFER_BUFFER_BYTES, 4 * self._record_bytes), "tcp", "",
                                master)
        if rc != 0:
            raise OSError(f"cannot join the Mooncake Store at {master} (setup returned {rc})")

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys or not self._up():
            return 0
        try:
            found = self._call(self._client.batch_is_exist, [PREFIX + key_text(k) for k in keys])
        except Exception as exc:  # the binding raises RuntimeError and others: any failure is a miss
            self._failed("contains", exc)
            return 0
        return next((i for i, n in enumerate(found) if n != 1), len(found))

    def get(self, key: bytes, sink: PayloadSink) -> bool:
        if not self._up():
            return self._miss()
        name, start = PREFIX + key_text(key), time.perf_counter()
        try:
            value = self._call(self._client.get, name)
        except Exception as exc:
            self._failed("get", exc)
            return self._miss()
        if not value:  # absent (evicted)
            return self._miss()
        if len(value) < _EXPIRY.size or _EXPIRY.unpack_from(value)[0] <= time.time():
            self._remove(name)
            with self._lock:
                self._stats.expirations += 1
            return self._miss()
        try:
            payload = payload_of(memoryview(value)[_EXPIRY.size:], key, self.payload_bytes, self._record_key)
        except CorruptRecord as exc:
            logger.warning("mooncake KV tier: dropped a corrupt block %s: %s", name[:24], exc)
            self._remove(name)
            with self._lock:
                self._stats.corrupt += 1
            return self._miss()
        sink(payload)
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += self.payload_bytes
            self._stats.read_seconds += time.perf_counter() - start
        return True

    def put(self, key: bytes, fill: PayloadFiller) -> bool:
        if not self._up():
            return self._dropped()
        name, start = PREFIX + key_text(key), time.perf_counter()
        record = bytearray(self._record_bytes)
        view = memoryview(record)
        fill(view[_EXPIRY.size + HEADER_BYTES:])
        write_header(view[_EXPIRY.size:], key, self.payload_bytes, self._record_key)
        _EXPIRY.pack_into(record, 0, time.time() + self.ttl_s)
        try:
            rc = self._call(self._replace, name, record)
        except Exception as exc:
            self._failed("put", exc)
            return self._dropped()
        if rc != 0:
            self._failed("put", OSError(f"put returned {rc} (the store is full, or down)"))
            return self._dropped()
        with self._lock:
            self._stats.bytes_written += self.payload_bytes
            self._stats.write_seconds += time.perf_counter() - start
        return True

    def _replace(self, name: str, record: bytearray) -> int:
        if self._client.is_exist(name) == 1:
            self._client.remove(name, True)  # refresh: a new expiry (Mooncake keeps an object's first value)
        return int(self._client.put(name, record))

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tier's thread, given up after CALL_TIMEOUT_S (TimeoutError). Callers on several
        threads (the engine's saves, the loader's gets) take turns; a call still stuck fails the next at once."""
        if not self._call_lock.acquire(timeout=CALL_TIMEOUT_S):
            raise TimeoutError("the store is busy with other calls")
        try:
            if self._pending is not None and not self._pending.done():
                raise TimeoutError("an earlier call to the store has not returned")
            self._pending = self._caller.submit(fn, *args)
            try:
                result = self._pending.result(timeout=CALL_TIMEOUT_S)
            except CallTimeout:
                raise TimeoutError(f"no answer within {CALL_TIMEOUT_S} s") from None
        finally:
            self._call_lock.release()
        with self._lock:
            self._failures_in_a_row = 0  # the store answered: the next failure starts the backoff again
        return result

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**vars(self._stats))

    def close(self) -> None:
        try:
            self._call(self._client.close)
        except Exception:  # closing a client of a dead store must not stop the engine's shutdown
            logger.warning("mooncake KV tier: close failed", exc_info=True)
        self._caller.shutdown(wait=False)

    # ---- failures ----

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._stats.errors += 1
            pause = min(RETRY_AFTER_S * 2**self._failures_in_a_row, MAX_RETRY_AFTER_S)
            self._failures_in_a_row += 1
            self._down_until = time.monotonic() + pause
        logger.warning("mooncake KV tier: %s failed (%s); skipping the tier for %.0f s", what, exc, pause)

    def _remove(self, name: str) -> None:
        try:
            self._call(self._client.remove, name, True)  # force: a read leases an object for 10 s
        except Exception as exc:
            self._failed("remove", exc)

    def _miss(self) -> bool:
        with self._lock:
            self._stats.misses += 1
        return False

    def _dropped(self) -> bool:
        with self._lock:
            self._stats.dropped_writes += 1
        return False
