"""L3: signed block files in a bounded directory, kept across restarts (by a process with the same cluster secret).

    <directory>/<key hex[:2]>/<key hex>.kvb     one record (`records`: header | payload, MAC'd) per block

A write lands whole or not at all: the writer fills `.<name>.<random>.tmp` next to the file (created
with O_EXCL | O_NOFOLLOW: a planted file or symlink is never written through) and renames it over
(`os.replace`), so a reader never sees a torn record. Writes run on one background thread:
`put` copies the payload into a private buffer and returns, the engine thread never waits on the
disk, and a writer that falls behind drops writes (counted) instead of queueing without bound.

Capacity is exact LRU over an in-memory index (touched by `get` and by a repeated `put`); a block
past its TTL is a miss and is deleted. On construction the index is rebuilt from the files on disk.

One DiskTier per directory, enforced: it holds an exclusive `flock` on `<directory>/.lock` while open
(several processes sharing a directory would each count only their own files against the capacity and
evict each other's blocks blindly), and refuses a directory another user owns or others may write
(whoever can write it serves its blocks to every matching prompt).
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import logging
import os
import queue
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvbaton.kv.store.base import KVTier, PayloadFiller, PayloadSink, TierStats
from kvbaton.kv.store.keys import KEY_BYTES, key_text
from kvbaton.kv.store.records import HEADER_BYTES, CorruptRecord, RecordKey, payload_of, write_header

logger = logging.getLogger(__name__)

QUEUE_RECORDS = 256  # records waiting for the writer; beyond that a put is dropped
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
_FULL_BACKOFF_S = 1.0  # after the disk or a quota says "full", skip writes this long
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_Job = tuple[bytes, bytearray]


@dataclass
class _Entry:
    size: int  # bytes of the record file
    expires_at: float  # wall clock (time.time()): the index is rebuilt from file mtimes after a restart


def _write_record(path: Path, record: bytearray) -> None:
    """Write `record` to `path` atomically: a temp file in the same directory, then a rename.

    NOTE: no fsync. After a power loss a renamed file may hold zeros or stale bytes; its MAC
    then fails and it reads as a miss, which is all a cache needs (fsync would cost milliseconds a block)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(record)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _claim(directory: Path) -> int:
    """Create `directory` (0700) if needed, check it is ours and not writable by others, and lock it for this
    tier (an fd holding an exclusive flock, released when closed or when the process dies)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(directory, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"disk tier: refusing {directory}: it must be a directory of uid {os.getuid()} that "
                              f"no one else may write (it is {'a directory' if stat.S_ISDIR(st.st_mode) else 'not one'}"
                              f" of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"disk tier: {directory} is in use by another DiskTier (another process, or a worker of "
                           f"another server with the same name): give each its own --kv-store-disk-dir") from None
    return fd


def _key_of(path: Path) -> bytes | None:
    """The key a record file is named for, or None when the name is not one this tier writes."""
    text = path.name[: -len(SUFFIX)]
    if len(text) != 2 * KEY_BYTES or path.parent.name != text[:2]:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return None
    return key if key_text(key) == text else None  # lowercase only: one file name per key


class DiskTier(KVTier):
    """Blocks as files under `directory`, at most `capacity_bytes` of them (header included), each
    kept `ttl_s` seconds after its last write or refresh, each signed under `record_key` (a file that does not
    verify under it is a miss, counted corrupt, and deleted). Thread-safe; `put` returns before the bytes land
    (`flush` waits for them)."""

    name = "disk"

    def __init__(self, directory: str | Path, payload_bytes: int, capacity_bytes: int, ttl_s: float, *,
                 record_key: RecordKey) -> None:
        if payload_bytes <= 0 or capacity_bytes < 0 or not ttl_s > 0:
            raise ValueError(f"disk tier: payload_bytes={payload_bytes} and ttl_s={ttl_s} must be positive, "
                             f"capacity_bytes={capacity_bytes} not negative")
        super().__init__(payload_bytes)
        self.directory = Path(directory)
        self.record_bytes = HEADER_BYTES + payload_bytes
        self.ttl_s = ttl_s
        self._record_key = record_key
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when `_pending` empties
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._expiry: list[tuple[float, bytes]] = []  # heap; lazy: an item may be stale (entry refreshed)
        self._pending: set[bytes] = set()  # keys queued or being written
        self._stats = TierStats(name=self.name, capacity_bytes=capacity_bytes)
        self._backoff_until = 0.0  # time.monotonic()
        self._warned: set[str] = set()
        self._closed = False
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=QUEUE_RECORDS)
        self._lock_fd = _claim(self.directory)
        self._load_index()
        self._writer = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # --- the KVTier contract ---

    def contains(self, keys: Sequence[bytes]) -> int:
        now = time.time()
        with self._lock:
            for count, key in enumerate(keys):
                if self._live_entry(key, now) is None:
                    return count
            return len(keys)

    def get(self, key: bytes, sink: PayloadSink) -> bool:
        with self._lock:
            entry = self._live_entry(key, time.time())
            if entry is None:
                self._stats.misses += 1
                return False
            self._index.move_to_end(key)
        start = time.perf_counter()
        try:
            with self._path(key).open("rb") as f:
                record = f.read(self.record_bytes + 1)  # one byte more: a longer file fails the length check
            payload = payload_of(record, key, self.payload_bytes, self._record_key)
        except CorruptRecord as exc:
            self._read_failed(key, entry, "corrupt", exc)
            return False
        except OSError as exc:
            self._read_failed(key, entry, "error", exc)
            return False
        elapsed = time.perf_counter() - start
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += self.payload_bytes
            self._stats.read_seconds += elapsed
        sink(payload)
        return True

    def put(self, key: bytes, fill: PayloadFiller) -> bool:
        with self._lock:
            if self._refresh(key) or key in self._pending:
                return True
            if not self._accepting():
                return False
        record = bytearray(self.record_bytes)
        view = memoryview(record)
        fill(view[HEADER_BYTES:])
        write_header(view, key, self.payload_bytes, self._record_key)
        return self._enqueue(key, record)

    def stats(self) -> TierStats:
        with self._lock:
            return replace(self._stats, blocks=len(self._index))

    def check_integrity(self) -> None:
        """The counters match the index, the index fits the capacity, and the index matches the files
        on disk (each indexed file exists with its size, no unindexed record files). Meant for an idle
        tier (after `flush`); blocks still being written are skipped."""
        with self._lock:
            sizes = sum(entry.size for entry in self._index.values())
            assert self._stats.used_bytes == sizes, f"used_bytes {self._stats.used_bytes} != {sizes} indexed"
            assert sizes <= self._stats.capacity_bytes, f"{sizes} bytes over capacity {self._stats.capacity_bytes}"
            for key, entry in self._index.items():
                path = self._path(key)
                assert path.is_file(), f"indexed block {path} is missing"
                assert path.stat().st_size == entry.size, f"{path} is not {entry.size} bytes"
            on_disk = {_key_of(path) for path in self._files() if path.name.endswith(SUFFIX)}
            stray = on_disk - self._index.keys() - self._pending
            assert not stray, f"{len(stray)} record files outside the index"

    def flush(self, timeout_s: float = 5.0) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._pending, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the writer drain (at most `timeout_s`), drop what is still queued, stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout_s)
        self._discard_queued()
        self._queue.put(None)  # room for it: nothing is enqueued once closed, and the queue was emptied
        self._writer.join(timeout_s)
        os.close(self._lock_fd)  # the directory is free for the next DiskTier

    # --- the index (callers hold the lock) ---

    def _live_entry(self, key: bytes, now: float) -> _Entry | None:
        """The key's entry, or None if absent or expired (an expired one is deleted)."""
        entry = self._index.get(key)
        if entry is not None and entry.expires_at <= now:
            self._drop(key, entry)
            self._stats.expirations += 1
            return None
        return entry

    def _refresh(self, key: bytes) -> bool:
        """Renew a present block's LRU position and expiry; False when it is absent or expired.

        NOTE: the renewed expiry lives in memory only: after a restart it is the file's mtime + ttl
        again (the write time), so a refreshed block may expire early there; a miss, never wrong bytes."""
        now = time.time()
        entry = self._live_entry(key, now)
        if entry is None:
            return False
        entry.expires_at = now + self.ttl_s
        self._index.move_to_end(key)
        self._push_expiry(key, entry)
        return True

    def _insert(self, key: bytes, size: int, expires_at: float) -> None:
        entry = _Entry(size, expires_at)
        self._index[key] = entry
        self._stats.used_bytes += size
        self._push_expiry(key, entry)

    def _push_expiry(self, key: bytes, entry: _Entry) -> None:
        heapq.heappush(self._expiry, (entry.expires_at, key))
        if len(self._expiry) > 2 * len(self._index) + 64:  # stale items from refreshes: rebuild
            self._expiry = [(e.expires_at, k) for k, e in self._index.items()]
            heapq.heapify(self._expiry)

    def _drop(self, key: bytes, entry: _Entry) -> None:
        """Forget a block and delete its file. NOTE: the unlink runs under the lock: it is cheap, and
        a block is never indexed without its file that way."""
        del self._index[key]
        self._stats.used_bytes -= entry.size
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            self._stats.errors += 1
            self._warn("unlink", "disk tier: cannot delete %s: %s", self._path(key), exc)

    def _prune_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, key = heapq.heappop(self._expiry)
            entry = self._index.get(key)
            if entry is not None and entry.expires_at <= now:  # else a stale item of a refreshed block
                self._drop(key, entry)
                self._stats.expirations += 1

    def _make_room(self, size: int) -> bool:
        """Delete expired blocks, then least recently used ones, until `size` more bytes fit."""
        self._prune_expired(time.time())
        while self._index and self._stats.used_bytes + size > self._stats.capacity_bytes:
            key, entry = next(iter(self._index.items()))
            self._drop(key, entry)
            self._stats.evictions += 1
        return self._stats.used_bytes + size <= self._stats.capacity_bytes

    def _accepting(self) -> bool:
        """Whether a new write may be queued now (counted as dropped when not)."""
        if self.record_bytes > self._stats.capacity_bytes:
            return False  # never fits: not a dropped write, a tier too small for one block
        if self._closed or time.monotonic() < self._backoff_until:
            self._stats.dropped_writes += 1
            return False
        return True

    # --- the writer thread ---

    def _enqueue(self, key: bytes, record: bytearray) -> bool:
        with self._lock:
            if key in self._pending or key in self._index:
                return True  # a concurrent put of the same block won
            if not self._accepting():
                return False
            try:
                self._queue.put_nowait((key, record))
            except queue.Full:
                self._stats.dropped_writes += 1
                return False
            self._pending.add(key)
        return True

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            key, record = job
            try:
                self._write(key, record)
            except Exception:  # a bug, not an I/O failure: keep the writer alive all the same
                logger.exception("disk tier: writing block %s failed", key_text(key))
                with self._lock:
                    self._stats.errors += 1
            finally:
                self._done(key)

    def _write(self, key: bytes, record: bytearray) -> None:
        with self._lock:
            if time.monotonic() < self._backoff_until:
                self._stats.dropped_writes += 1
                return
            if not self._make_room(len(record)):
                return
        start = time.perf_counter()
        try:
            _write_record(self._path(key), record)
        except OSError as exc:
            self._write_failed(exc)
            return
        elapsed = time.perf_counter() - start
        with self._lock:
            # NOTE: only this thread inserts, so the room made above is still there.
            self._insert(key, len(record), time.time() + self.ttl_s)
            self._stats.bytes_written += self.payload_bytes
            self._stats.write_seconds += elapsed

    def _write_failed(self, exc: OSError) -> None:
        with self._lock:
            self._stats.errors += 1
            if exc.errno in _FULL_ERRNOS:
                self._backoff_until = time.monotonic() + _FULL_BACKOFF_S
            self._warn(f"write-{exc.errno}", "disk tier: writing under %s failed: %s", self.directory, exc)

    def _done(self, key: bytes) -> None:
        with self._idle:
            self._pending.discard(key)
            if not self._pending:
                self._idle.notify_all()

    def _discard_queued(self) -> None:
        """Drop every queued write (the tier is closing and the writer did not get to them)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                with self._lock:
                    self._stats.dropped_writes += 1
                self._done(job[0])

    # --- reads and restarts ---

    def _read_failed(self, key: bytes, entry: _Entry, kind: str, exc: Exception) -> None:
        """A block that could not be read: a miss, and forgotten (its file deleted) unless it was
        evicted or replaced meanwhile (then the failure was the race, not the file)."""
        with self._lock:
            self._stats.misses += 1
            if self._index.get(key) is not entry:
                return
            if kind == "corrupt":
                self._stats.corrupt += 1
            else:
                self._stats.errors += 1
            self._drop(key, entry)
            self._warn(kind, "disk tier: dropping block %s: %s", key_text(key), exc)

    def _load_index(self) -> None:
        """Index the record files a previous run left, oldest first; delete temp files, records of the
        wrong size, expired ones, and the oldest beyond capacity.

        NOTE: after a restart the LRU order is the write order (file mtimes): reads do not touch files,
        so the recency of reads before the restart is lost."""
        now = time.time()
        found = [kept for path in self._files() if (kept := self._survivor(path, now)) is not None]
        with self._lock:
            for mtime, key in sorted(found):
                self._insert(key, self.record_bytes, mtime + self.ttl_s)
            self._make_room(0)
        if self._index:
            logger.info("disk tier: %d blocks (%d bytes) in %s", len(self._index), self._stats.used_bytes,
                        self.directory)

    def _survivor(self, path: Path, now: float) -> tuple[float, bytes] | None:
        """(mtime, key) of a record file that may stay. Anything else of ours (a temp file, a record
        misnamed, of the wrong size or expired) is deleted; files of other names are left alone."""
        is_record = path.name.endswith(SUFFIX)
        if not (is_record or path.name.endswith(TEMP_SUFFIX)):
            return None
        try:
            st = path.stat()
            key = _key_of(path) if is_record else None
            if (key is not None and stat.S_ISREG(st.st_mode) and st.st_size == self.record_bytes
                    and st.st_mtime + self.ttl_s > now):
                return st.st_mtime, key
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._warn("scan", "disk tier: cannot clean up %s: %s", path, exc)
        return None

    def _files(self) -> Iterator[Path]:
        """Every entry one level down (in the shard directories), hidden temp files included."""
        for shard in self.directory.iterdir():
            if shard.is_dir():
                yield from shard.iterdir()

    def _path(self, key: bytes) -> Path:
        text = key_text(key)
        return self.directory / text[:2] / f"{text}{SUFFIX}"

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log a failure of this kind once at WARNING, every later one at DEBUG (a failing disk
        would otherwise log once a block)."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        logger.log(level, message, *args)
