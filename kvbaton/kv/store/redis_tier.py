"""L4: a cluster-wide Redis, every block under a TTL.

    put(key, fill) ─▶ record = header | payload ─▶ queue (≤ max_pending) ─▶ writer thread:
                                                   SET <prefix><hex key> <record> PX ttl_ms, ≤ 16 per pipeline
    contains(keys) ─▶ one pipeline of EXISTS, one per key
    get(key)       ─▶ GET, then the record's header and MAC are checked

* **Framing.** A value is a `records` frame (header naming the key, a MAC over key and payload
  under `record_key`): a torn, altered, forged or misplaced value (another key's record under this
  name, or one signed under another cluster secret) reads as a miss, counted `corrupt`, and is
  deleted. Redis is trusted with neither integrity nor authenticity: its password is one more
  secret every client holds.
* **TTL.** Every SET carries `PX ttl_ms`, so no block outlives `ttl_s` after its last write. A
  put of a key already there overwrites it and restarts its TTL (no EXISTS first: one round
  trip, not two). GET does not extend a TTL.
* **Capacity and eviction are the server's.** Run it with `maxmemory` and `maxmemory-policy
  allkeys-lru` (`start_redis_server(maxmemory_mb=..., maxmemory_policy="allkeys-lru")`). That LRU
  is approximate, not exact: Redis samples `maxmemory-samples` keys per eviction (keeping a small
  pool of the best candidates seen), so an old key may outlive a slightly newer one. GET refreshes
  a key's recency; EXISTS does not. Under `noeviction` a full server refuses SETs (OOM): errors,
  like a dead server, until keys expire.
* **Occupancy is an estimate.** `stats()` never touches the network: `used_bytes`/`blocks` count
  the records this tier has landed (capped at `capacity_bytes` when given), not what the server
  still holds; expiry and eviction happen there, unseen, so `evictions`/`expirations` stay 0.
* **Failures cost one timeout.** The client has `timeout_s` socket and connect timeouts and no
  retries. After any Redis error (refused, timed out, OOM...) the tier counts it and is down for
  `retry_after_s`: contains → 0, get → miss, put → dropped, with no network at all; the first
  call after the pause tries again. A killed or stalled server costs one `timeout_s`, then nothing.
* **Writes are asynchronous.** `fill` runs inside `put`; the record then waits in a bounded queue
  (full → dropped). `dropped_writes` counts every record offered that never landed: queue full,
  tier down, or its batch failed (a failed round trip also counts once in `errors`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import redis as redis_py
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from kvbaton.kv.store.base import KVTier, PayloadFiller, PayloadSink, TierStats
from kvbaton.kv.store.keys import key_text
from kvbaton.kv.store.records import HEADER_BYTES, CorruptRecord, RecordKey, payload_of, write_header

logger = logging.getLogger(__name__)

_BATCH = 16  # SETs per pipeline round trip
_CLOSE_S = 5.0  # close() waits this long for queued writes to land
_ERRORS = (redis_py.RedisError, OSError)


def redis_client(url: str, timeout_s: float) -> redis_py.Redis:
    """A client whose every call fails within ~timeout_s: no retries (redis-py retries 3 times, with
    backoff, by default), short connect and socket timeouts."""
    # NOTE: the pure-Python packer sends a large value as it is, where hiredis's copies it first.
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis_py.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0), command_packer=packer)


class RedisTier(KVTier):
    """Blocks in a Redis under `prefix + key_text(key)`; see the module docstring for the rules."""

    name = "redis"

    def __init__(self, url: str, payload_bytes: int, ttl_s: float, *, record_key: RecordKey, prefix: str = "kvb:kv:",
                 timeout_s: float = 0.25, retry_after_s: float = 2.0, max_pending: int = 256,
                 capacity_bytes: int = 0) -> None:
        super().__init__(payload_bytes)
        if payload_bytes <= 0 or ttl_s <= 0 or timeout_s <= 0 or retry_after_s < 0 or max_pending < 1:
            raise ValueError("RedisTier needs payload_bytes, ttl_s, timeout_s and max_pending > 0, retry_after_s >= 0")
        self._prefix = prefix
        self._record_key = record_key
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._record_bytes = HEADER_BYTES + payload_bytes
        self._max_blocks = capacity_bytes // self._record_bytes if capacity_bytes > 0 else None
        self._retry_after_s = retry_after_s
        self._max_pending = max_pending
        self._client = redis_client(url, timeout_s)
        self._lock = threading.Lock()  # guards _stats, _landed and _down_until
        self._stats = TierStats(self.name, max(0, capacity_bytes), shared=True)
        self._landed = 0  # records this tier has written
        self._down_until = 0.0  # time.monotonic() before which the breaker is open
        self._wake = threading.Condition()  # guards _queue, _in_flight and _closing (taken before _lock, never after)
        self._queue: deque[tuple[str, bytearray]] = deque()
        self._in_flight = 0
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="kvb-redis-tier-writer", daemon=True)
        self._writer.start()

    # --- the KVTier contract ---

    def contains(self, keys: Sequence[bytes]) -> int:
        names = [self._name(key) for key in keys]
        if not names or not self._up():
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            found = pipe.execute()
        except _ERRORS as exc:
            self._failed("contains", exc)
            return 0
        return next((i for i, n in enumerate(found) if not n), len(found))

    def get(self, key: bytes, sink: PayloadSink) -> bool:
        name = self._name(key)
        if not self._up():
            return self._miss()
        start = time.perf_counter()
        try:
            value = self._client.get(name)
        except _ERRORS as exc:
            self._failed("get", exc)
            return self._miss()
        if not isinstance(value, bytes):  # None: absent or expired
            return self._miss()
        try:
            payload = payload_of(value, key, self.payload_bytes, self._record_key)
        except CorruptRecord as exc:
            self._drop_corrupt(name, exc)
            return False
        elapsed = time.perf_counter() - start
        sink(payload)
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += self.payload_bytes
            self._stats.read_seconds += elapsed
        return True

    def put(self, key: bytes, fill: PayloadFiller) -> bool:
        name = self._name(key)
        if not self._up() or not self._has_room():  # checked before fill: a dropped block costs no copy
            return self._dropped(1)
        record = bytearray(self._record_bytes)
        view = memoryview(record)
        fill(view[HEADER_BYTES:])
        write_header(view, key, self.payload_bytes, self._record_key)
        with self._wake:
            if self._closing or len(self._queue) >= self._max_pending:
                accepted = False
            else:
                self._queue.append((name, record))
                self._wake.notify_all()
                accepted = True
        return accepted or self._dropped(1)

    def stats(self) -> TierStats:
        with self._lock:
            return replace(self._stats)

    def check_integrity(self) -> None:
        with self._wake:
            assert len(self._queue) <= self._max_pending, "write queue over max_pending"
            assert 0 <= self._in_flight <= _BATCH, f"{self._in_flight} records in flight"
            assert self._closing or self._writer.is_alive(), "the writer thread died"
        with self._lock:
            s, landed = replace(self._stats), self._landed
        counters = (s.hits, s.misses, s.bytes_read, s.bytes_written, s.corrupt, s.errors, s.dropped_writes)
        assert min(counters) >= 0 and s.read_seconds >= 0 and s.write_seconds >= 0, f"negative counter in {s}"
        assert s.corrupt <= s.misses, "every corrupt record is a miss too"
        assert s.bytes_written == landed * self.payload_bytes, "bytes_written disagrees with the records landed"
        assert s.blocks == (landed if self._max_blocks is None else min(landed, self._max_blocks))
        assert s.used_bytes == s.blocks * self._record_bytes, "used_bytes disagrees with blocks"

    def flush(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._wake.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def close(self) -> None:
        self.flush(_CLOSE_S)
        with self._wake:
            left, self._closing = len(self._queue), True
            self._queue.clear()
            self._wake.notify_all()
        if left:
            self._dropped(left)
        self._writer.join(_CLOSE_S)
        self._client.close()

    # --- the writer thread ---

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return  # closing, and nothing left
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
                self._in_flight = len(batch)
            try:
                self._write(batch)
            except Exception:  # NOTE: a bug here must not stop every later write
                logger.exception("redis tier: the writer failed on %d records", len(batch))
                self._dropped(len(batch))
            finally:
                with self._wake:
                    self._in_flight = 0
                    self._wake.notify_all()

    def _write(self, batch: list[tuple[str, bytearray]]) -> None:
        if not self._up():
            self._dropped(len(batch))
            return
        start = time.perf_counter()
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, record in batch:
                pipe.set(name, record, px=self._ttl_ms)
            results = pipe.execute(raise_on_error=False)  # a refused SET (OOM) comes back as its exception
        except _ERRORS as exc:
            self._failed("write", exc)
            self._dropped(len(batch))
            return
        elapsed = time.perf_counter() - start
        landed = sum(1 for result in results if result is True)
        self._landed_records(landed, elapsed)
        self._dropped(len(batch) - landed)
        refusal = next((result for result in results if isinstance(result, Exception)), None)
        if refusal is not None:
            self._failed("write", refusal)

    # --- bookkeeping ---

    def _name(self, key: bytes) -> str:
        return self._prefix + key_text(key)

    def _has_room(self) -> bool:
        with self._wake:
            return not self._closing and len(self._queue) < self._max_pending

    def _up(self) -> bool:
        """False while the breaker is open (an error less than retry_after_s ago)."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._stats.errors += 1
            self._down_until = time.monotonic() + self._retry_after_s
        logger.warning("redis tier: %s failed (%s: %s); skipping redis for %.1f s", what, type(exc).__name__, exc,
                       self._retry_after_s)

    def _miss(self) -> bool:
        with self._lock:
            self._stats.misses += 1
        return False

    def _dropped(self, n: int) -> bool:
        if n:
            with self._lock:
                self._stats.dropped_writes += n
        return False

    def _landed_records(self, n: int, elapsed: float) -> None:
        with self._lock:
            self._landed += n
            self._stats.bytes_written += n * self.payload_bytes
            self._stats.write_seconds += elapsed
            self._stats.blocks = self._landed if self._max_blocks is None else min(self._landed, self._max_blocks)
            self._stats.used_bytes = self._stats.blocks * self._record_bytes

    def _drop_corrupt(self, name: str, exc: CorruptRecord) -> None:
        with self._lock:
            self._stats.corrupt += 1
            self._stats.misses += 1
        logger.warning("redis tier: %s is corrupt (%s); deleting it", name, exc)
        try:
            self._client.delete(name)
        except _ERRORS as err:
            self._failed("delete", err)
