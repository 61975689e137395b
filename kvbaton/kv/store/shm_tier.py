"""L2: node-local shared memory. One arena in /dev/shm that every worker on the host maps, so a
block one worker computed is copied by another straight from the arena into its pool.

    superblock (PAGE) | headers [num_sets x WAYS] | payloads [num_sets x WAYS] (page aligned)

Set-associative, like a CPU cache: a key lives in set `key mod num_sets`, in one of its WAYS
slots. Eviction takes the set's empty, expired or least recently used slot: an approximate LRU
(exact within a set of WAYS, not across sets), which needs no shared list to keep in order.

Concurrency across processes: one POSIX record lock per set (a byte of the arena file). Readers
hold it shared while they copy a payload out; a writer holds it exclusive only to claim a slot
(marking it WRITING, which readers skip) and to publish it (READY), and copies the payload in
between without the lock. A writer that dies mid-copy leaves its slot WRITING; once its process is
gone (the slot names its PID) and STALE_S have passed, the slot is free again. A writer that is only
stalled keeps its slot however long: handed to another block, the slot would take the stalled
writer's bytes over the new block's when it woke (its publish would fail, but the copy would land).
POSIX locks go with their process, so a killed worker never holds one.
`contains` reads headers without locks: a wrong answer costs a failed load (recomputed), never
wrong KV, because `get` checks the header again under the lock.

A worker writes a step's blocks through right after it sends the step's outputs, so a request that
reaches another worker a few milliseconds later (the next request of a conversation, the second of
a group sharing a system prompt) finds the prefix half written. `contains` then waits, at most
IN_FLIGHT_WAIT_S, for blocks that another worker is writing at that moment (claimed within the last
IN_FLIGHT_AGE_S), or that the writer is about to claim (it published the block before just now):
cheaper than recomputing them, and bounded, so a stalled or dead writer costs that wait once.

The arena records no owner: servers may share one on purpose (`--kv-store-shm-name`). The one `kvbaton serve`
makes for its own workers is named for its PID (`serve_arena_name`), so that a later server's janitor
(`kvbaton.cluster.janitor`) can tell one that a killed server left behind (`arena_owner`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvbaton.kv.store.base import KVTier, PayloadFiller, PayloadSink, TierStats
from kvbaton.kv.store.keys import KEY_BYTES, safe_arena_name

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PAGE = 4096
WAYS = 16  # 8 ways filled ~60% of an arena of random keys before a set overflowed; 16 go further
STALE_S = 10.0  # a slot WRITING this long, whose writer's process is gone, is free again
IN_FLIGHT_WAIT_S = 0.25  # the longest `contains` waits for blocks being written (a 2k-token prefix: ~20-50 ms)
IN_FLIGHT_AGE_S = 0.05  # a slot claimed (or a block published) this recently has a live writer at work
IN_FLIGHT_GAP_S = 0.01  # a writer publishes a block and claims the next within this (a descheduled one included)
POLL_S = 0.0005
MAGIC = b"KVBSHM01"
_SUPER = struct.Struct("<8sQQQ")  # magic, payload_bytes, num_sets, ways
EMPTY, WRITING, READY = 0, 1, 2
# NOTE: the key as raw bytes (u1), not numpy "S": that strips trailing NULs, and hashes end in one 1 time in 256
HEADER_DTYPE = np.dtype([("key", "u1", (KEY_BYTES,)), ("state", "<u4"), ("writer", "<u4"),  # its PID, 0: none
                         ("last_access", "<f8"), ("expires", "<f8")])


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (0, an arena written before slots named their writer: no)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def arena_path(name: str, payload_bytes: int) -> str:
    """Arenas are per payload size: workers of other layouts on the host use other arenas."""
    return os.path.join(SHM_DIR, f"{safe_arena_name(name)}-{payload_bytes}")


def serve_arena_name() -> str:
    """A fresh arena name for one `kvbaton serve`'s workers, with the server's PID in it (see `arena_owner`)."""
    return f"serve-{os.getpid()}-{secrets.token_hex(3)}"


_SERVE_NAME = r"serve-(\d+)-[0-9a-f]{6}"  # `serve_arena_name`'s, its PID captured
_SERVE_ARENA = re.compile(rf"kvb-store-{_SERVE_NAME}-\d+")  # its file: `arena_path`
_HALF_MADE = re.compile(r"kvb-[\w.-]+-\d+\.(\d+)\.\d+\.tmp")  # `_create_arena`'s private name: its maker's PID


def arena_owner(file_name: str) -> int | None:
    """The PID that an arena file in SHM_DIR belongs to: the `kvbaton serve` a serve arena is named for, or the
    worker that was building a half-made one. None for any other file, an operator-named arena included:
    servers that come and go share it on purpose, and no process owns it."""
    match = _SERVE_ARENA.fullmatch(file_name) or _HALF_MADE.fullmatch(file_name)
    return int(match.group(1)) if match else None


def arena_owner_pid(name: str) -> int | None:
    """The PID of the `kvbaton serve` that named arena `name` (`serve_arena_name`), or None for another name."""
    match = re.fullmatch(_SERVE_NAME, name)
    return int(match.group(1)) if match else None


def has_arena_header(fd: int) -> bool:
    return os.pread(fd, len(MAGIC), 0) == MAGIC


def remove_arenas(name: str) -> None:
    """Remove the arenas of `name`, of every payload size (mapped workers keep their memory until they unmap it)."""
    for path in glob.glob(glob.escape(os.path.join(SHM_DIR, safe_arena_name(name))) + "-*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _geometry(capacity_bytes: int, payload_bytes: int) -> tuple[int, int, int]:
    """(num_sets, header offset, payload offset) of an arena of about `capacity_bytes` of payloads."""
    num_sets = max(1, capacity_bytes // payload_bytes // WAYS)
    headers = PAGE
    payloads = -(-(headers + num_sets * WAYS * HEADER_DTYPE.itemsize) // PAGE) * PAGE
    return num_sets, headers, payloads


class ShmTier(KVTier):
    name = "shm"
    in_memory = True

    def __init__(self, name: str, payload_bytes: int, capacity_bytes: int, ttl_s: float) -> None:
        super().__init__(payload_bytes)
        self.path = arena_path(name, payload_bytes)
        self.ttl_s = ttl_s
        self._fd, self._mm = _open_arena(self.path, payload_bytes, capacity_bytes)
        self.num_sets, header_offset, self._payload_offset = self._read_superblock()
        self._headers = np.ndarray((self.num_sets, WAYS), HEADER_DTYPE, buffer=self._mm, offset=header_offset)
        self._thread_lock = threading.RLock()  # POSIX record locks are per process, not per thread
        self._stats = TierStats(self.name, capacity_bytes=self.num_sets * WAYS * payload_bytes, shared=True)

    def _read_superblock(self) -> tuple[int, int, int]:
        magic, payload_bytes, num_sets, ways = _SUPER.unpack_from(self._mm, 0)
        if magic != MAGIC or payload_bytes != self.payload_bytes or ways != WAYS:
            raise ValueError(f"{self.path} is not a KV store arena of {self.payload_bytes}-byte blocks")
        _, header_offset, payload_offset = _geometry(num_sets * WAYS * payload_bytes, payload_bytes)
        if len(self._mm) < payload_offset + num_sets * WAYS * payload_bytes:
            raise ValueError(f"{self.path} is shorter than its superblock says")
        return num_sets, header_offset, payload_offset

    # ---- the contract ----------------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> int:
        n, deadline = 0, time.monotonic() + IN_FLIGHT_WAIT_S
        while n < len(keys):
            now = time.time()
            if self._find(self._set_of(keys[n]), keys[n], now) is not None:
                n += 1
                continue
            if time.monotonic() >= deadline or not self._in_flight(keys, n, now):
                break
            time.sleep(POLL_S)
        return n

    def _in_flight(self, keys: Sequence[bytes], n: int, now: float) -> bool:
        """Is keys[n] being written right now (claimed very recently), or was keys[n - 1] published just now by a
        writer that is about to claim keys[n]? (Racy reads: a wrong answer costs at most a short wait.)"""
        row = self._headers[self._set_of(keys[n])]
        mine = (row["key"] == np.frombuffer(keys[n], np.uint8)).all(axis=1)
        if ((row["state"] == WRITING) & mine & (now - row["last_access"] < IN_FLIGHT_AGE_S)).any():
            return True
        if n == 0:
            return False
        prev = self._headers[self._set_of(keys[n - 1])]
        way = self._find(self._set_of(keys[n - 1]), keys[n - 1], now)
        # published just now (a publish sets `expires`, a read does not): its writer may be between it and keys[n]
        return way is not None and now - (prev[way]["expires"] - self.ttl_s) < IN_FLIGHT_GAP_S

    def get(self, key: bytes, sink: PayloadSink) -> bool:
        set_index = self._set_of(key)
        start = time.perf_counter()
        with self._locked(set_index, exclusive=False):
            way = self._find(set_index, key, time.time())
            if way is not None:
                sink(self._payload(set_index, way))
                self._headers[set_index, way]["last_access"] = time.time()  # racy by design: an LRU hint
        self._count_read(way is not None, time.perf_counter() - start)
        return way is not None

    def put(self, key: bytes, fill: PayloadFiller) -> bool:
        set_index = self._set_of(key)
        start = time.perf_counter()
        way = self._claim(set_index, key)
        if way is None:
            return True  # present already (refreshed), or every slot of the set is being written
        try:
            fill(self._payload(set_index, way))
        except BaseException:
            self._publish(set_index, way, key, EMPTY)  # a half-written payload must not be read
            raise
        self._publish(set_index, way, key, READY)
        with self._thread_lock:
            self._stats.bytes_written += self.payload_bytes
            self._stats.write_seconds += time.perf_counter() - start
        return True

    def stats(self) -> TierStats:
        now = time.time()
        ready = (self._headers["state"] == READY) & (self._headers["expires"] > now)
        with self._thread_lock:
            s = TierStats(**vars(self._stats))
        s.blocks = int(ready.sum())
        s.used_bytes = s.blocks * self.payload_bytes
        return s

    def check_integrity(self) -> None:
        states = self._headers["state"]
        assert set(np.unique(states).tolist()) <= {EMPTY, WRITING, READY}, "unknown slot state"
        for set_index in range(self.num_sets):
            keys = [k.tobytes() for k, s in zip(self._headers[set_index]["key"], states[set_index]) if s == READY]
            assert len(keys) == len(set(keys)), f"a key twice in set {set_index}"
            assert all(self._set_of(k) == set_index for k in keys), f"a key in the wrong set {set_index}"

    def close(self) -> None:
        if self._fd >= 0:
            del self._headers
            self._mm.close()
            os.close(self._fd)
            self._fd = -1

    @staticmethod
    def destroy(name: str, payload_bytes: int) -> None:
        """Remove the arena's name (mapped workers keep their memory until they unmap it)."""
        try:
            os.unlink(arena_path(name, payload_bytes))
        except FileNotFoundError:
            pass

    # ---- slots -----------------------------------------------------------------------------------

    def _set_of(self, key: bytes) -> int:
        return int.from_bytes(key[-8:], "little") % self.num_sets

    def _payload(self, set_index: int, way: int) -> memoryview:
        offset = self._payload_offset + (set_index * WAYS + way) * self.payload_bytes
        return memoryview(self._mm)[offset:offset + self.payload_bytes]

    def _find(self, set_index: int, key: bytes, now: float) -> int | None:
        row = self._headers[set_index]
        match = (row["key"] == np.frombuffer(key, np.uint8)).all(axis=1) & (row["state"] == READY)
        ways = np.flatnonzero(match & (row["expires"] > now))
        return int(ways[0]) if len(ways) else None

    def _claim(self, set_index: int, key: bytes) -> int | None:
        """Under the set's lock: refresh `key` if present (None), else mark the set's victim WRITING for it."""
        now = time.time()
        with self._locked(set_index, exclusive=True):
            row = self._headers[set_index]
            way = self._find(set_index, key, now)
            if way is not None:
                row[way]["expires"], row[way]["last_access"] = now + self.ttl_s, now
                return None
            way = self._victim(row, now)
            if way is None:  # every slot of the set is being written: skip this block
                self._stats.dropped_writes += 1
                return None
            self._count_eviction(row[way], now)
            row[way]["key"] = np.frombuffer(key, np.uint8)
            row[way]["state"], row[way]["last_access"], row[way]["writer"] = WRITING, now, os.getpid()
            return way

    @staticmethod
    def _victim(row: np.ndarray, now: float) -> int | None:
        """An empty slot, else an expired one, else the least recently used; never one being written."""
        best, best_rank = None, None
        for way in range(WAYS):
            state, access, expires = row[way]["state"], row[way]["last_access"], row[way]["expires"]
            if state == WRITING and (now - access < STALE_S or _alive(int(row[way]["writer"]))):
                continue
            rank = (0 if state != READY else 1 if expires <= now else 2, access)
            if best_rank is None or rank < best_rank:
                best, best_rank = way, rank
        return best

    def _count_eviction(self, header: np.void, now: float) -> None:
        if header["state"] == READY:
            with self._thread_lock:
                if header["expires"] <= now:
                    self._stats.expirations += 1
                else:
                    self._stats.evictions += 1

    def _publish(self, set_index: int, way: int, key: bytes, state: int) -> None:
        now = time.time()
        with self._locked(set_index, exclusive=True):
            header = self._headers[set_index, way]
            if header["state"] == WRITING and header["key"].tobytes() == key:  # still ours (not reclaimed as stale)
                header["expires"], header["last_access"], header["state"] = now + self.ttl_s, now, state

    def _count_read(self, hit: bool, seconds: float) -> None:
        with self._thread_lock:
            if hit:
                self._stats.hits += 1
                self._stats.bytes_read += self.payload_bytes
                self._stats.read_seconds += seconds
            else:
                self._stats.misses += 1

    @contextmanager
    def _locked(self, set_index: int, exclusive: bool) -> Iterator[None]:
        # NOTE: the thread lock in shared mode too: a second thread's LOCK_SH would convert this process's
        # exclusive record lock, and its unlock would drop it.
        with self._thread_lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, 1, set_index)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, set_index)


def _open_arena(path: str, payload_bytes: int, capacity_bytes: int) -> tuple[int, mmap.mmap]:
    """Map the arena at `path`, creating it if no worker has yet (exactly one creator wins)."""
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"the shm KV tier needs POSIX shared memory in {SHM_DIR} (Linux)")
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            _create_arena(path, payload_bytes, capacity_bytes)
            continue
        if os.fstat(fd).st_uid != os.getuid():
            os.close(fd)
            raise PermissionError(f"refusing KV store arena {path}: owned by another user")
        size = os.fstat(fd).st_size
        if size >= PAGE:
            return fd, mmap.mmap(fd, size)
        os.close(fd)
        time.sleep(0.01)
    raise RuntimeError(f"KV store arena {path} did not appear")


def _create_arena(path: str, payload_bytes: int, capacity_bytes: int) -> None:
    """Build the arena under a private name, then link it into place: others see it whole or not at all."""
    num_sets, _, payload_offset = _geometry(capacity_bytes, payload_bytes)
    size = payload_offset + num_sets * WAYS * payload_bytes
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # NOTE: reserve the pages now: a full tmpfs then fails here, not with SIGBUS at a first write.
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, _SUPER.pack(MAGIC, payload_bytes, num_sets, WAYS), 0)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another worker made it first: use theirs
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OSError(exc.errno, f"cannot reserve {size / 2**20:.0f} MiB for the KV store in {SHM_DIR}; "
                                     "give it more room or a smaller --kv-store-shm-gb") from exc
        raise
    finally:
        os.close(fd)
        os.unlink(tmp)
