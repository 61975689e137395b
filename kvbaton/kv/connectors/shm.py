"""The `shm` transport: prefill and decode workers on one host, KV moved through shared memory.

Zero extra copies when the prefill worker's pool lives in shared memory
(`allocate_shared_kv_caches`): a layer message only names the rows, and the receiver copies them
straight from the sender's pool into its own, inside poll(). With a plain pool the sender first
copies each layer's rows into a staging segment (one more copy, on its I/O thread; segments are
reused from one transfer to the next, and stay mapped on both sides while in use).

    prefill: save_layer(i) ── ShmLayer(segment, offset, rows) over ZeroMQ (127.0.0.1, signed) ──▶ decode
    decode:  poll(): memmove rows from the mapped segment into dst blocks; after the last layer ──▶ Ack

Shared memory is private to the host, so the bulk data is not MACed; the control messages are
(SignedCodec), and a receiver maps only segments named in signed messages, read-only.

Cleanup: the creator unlinks its segments (`SharedKVPool.close()`; staging segments at
`Sender.close()`, or when a transfer ends without the receiver's word) and registers them with
multiprocessing's resource tracker, which unlinks them if the process dies first (when the
tracker's last user exits: right away for a worker started with subprocess, at the launcher's exit
for one started by multiprocessing). An unlinked segment stays readable by whoever has it mapped,
so a receiver never faults on a dead sender: it fails that sender's transfers (its pid is gone, or
by the deadline) and unmaps its segments.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import re
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from kvbaton.kv.connectors._transport import Incoming, Outgoing, SenderFailed, ZmqReceiver, ZmqSender
from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.rows import copy_rows, rows_within

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory; segments are opened here by name
PAGE = 4096
PID_CHECK_S = 0.5  # how often a receiver checks that its senders are alive
STAGING_IDLE_S = 10.0  # a receiver unmaps a staging segment unused this long
MIN_STAGING_BYTES = 2**20
MAX_SPARE_STAGING = 4  # staging segments a sender keeps for reuse
_NAME_OK = re.compile(r"kvb-[A-Za-z0-9_.-]{1,200}")
_counter = itertools.count()


def segment_name(worker_name: str, kind: str) -> str:
    """Unique per worker, process and use, so test runs and workers never clash."""
    worker = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_name)[:64]
    return f"kvb-{worker}-{os.getpid()}-{kind}{next(_counter)}"


class Segment:
    """A mapped POSIX shared-memory segment; `address` is where its first byte is in this process."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name, self.mm, self.size, self.owner = name, mm, len(mm), owner
        self._view = np.frombuffer(mm, dtype=np.uint8)  # [size]; keeps the address valid while mapped
        self.address = self._view.ctypes.data

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        _require_shm_dir()
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # NOTE: reserve the pages now: an over-committed tmpfs (Docker's 64 MB /dev/shm) then
            # fails here with ENOSPC instead of SIGBUS-ing the worker on first write.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.unlink(path)
            raise OSError(exc.errno, f"cannot reserve {size / 2**20:.0f} MiB in {SHM_DIR} ({exc.strerror}); "
                                     "give it more room (docker --shm-size) or use the tcp transport") from exc
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, "shared_memory")  # unlinked for us if we die first
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map someone else's segment read-only (and untracked: its creator owns the name)."""
        if not _NAME_OK.fullmatch(name):
            raise ValueError(f"refusing shared memory segment name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            # NOTE: prot, not access=ACCESS_READ, so a PROT_READ mapping still exposes a buffer numpy
            # can take an address from; nothing here writes through it
            mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def unlink(self) -> None:
        if not self.owner:
            return
        self.owner = False
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        resource_tracker.unregister("/" + self.name, "shared_memory")

    def close(self) -> None:
        """Unmap now: only for segments nothing else points into (staging, receivers' mappings)."""
        self._view = None
        self.mm.close()


class SharedKVPool:
    """Handle of KV pools allocated in one shared-memory segment. close() unlinks its name (call it
    at shutdown); the memory itself is freed when the last mapping goes: here when the tensors are
    garbage (they hold the mapping), in receivers when they unmap it."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    @property
    def name(self) -> str:
        return self.segment.name

    def contains(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of `tensor` in the segment, if it lies inside."""
        start = tensor.data_ptr() - self.segment.address
        end = start + tensor.numel() * tensor.element_size()
        return start if 0 <= start and end <= self.segment.size else None

    def close(self) -> None:
        # NOTE: no munmap here: the tensors may outlive this call, and torch.frombuffer does not
        # pin the buffer, so closing the mmap would pull the memory from under them
        _SHARED_POOLS.pop(self.name, None)
        self.segment.unlink()


# NOTE: module-level, so a Sender recognises a shared pool from its tensors alone and the connector
# constructor stays `(config, layout, kv_caches)` for every transport.
_SHARED_POOLS: dict[str, SharedKVPool] = {}


def allocate_shared_kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                              name_prefix: str) -> tuple[list[torch.Tensor], SharedKVPool]:
    """Per-layer KV pools `shape` (`[slots, 2, Hkv, D]`), zeroed, in one shared-memory segment named
    after `name_prefix` (the worker name) and this pid. A shm `Sender` built on these tensors sends
    without copying: receivers read the blocks straight from it. Call `pool.close()` at shutdown."""
    layer_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    stride = -(-layer_bytes // PAGE) * PAGE  # each layer page-aligned
    segment = Segment.create(segment_name(name_prefix, "pool"), stride * num_layers)
    caches = [torch.frombuffer(segment.mm, dtype=dtype, count=math.prod(shape), offset=i * stride).view(shape)
              for i in range(num_layers)]
    pool = SharedKVPool(segment)
    _SHARED_POOLS[pool.name] = pool
    return caches, pool


def _shared_region(tensor: torch.Tensor) -> tuple[str, int] | None:
    for pool in _SHARED_POOLS.values():
        if (offset := pool.contains(tensor)) is not None:
            return pool.name, offset
    return None


class ShmLayer(msgspec.Struct, tag="shm_layer", frozen=True):
    """Prefill -> decode: layer `layer` of the request is in `segment`, block-rows `rows` from `offset`."""

    request_id: str
    layer: int
    layout: KVLayout
    ack_to: str
    sender_pid: int
    segment: str
    offset: int  # bytes from the segment's start to row 0
    rows: list[int]  # in dst_block_ids order
    staging: bool  # a staging segment (mapped while in use), not the sender's pool (mapped for good)

    @property
    def num_blocks(self) -> int:
        return len(self.rows)


class Sender(ZmqSender):
    host = "127.0.0.1"

    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(config, layout, kv_caches)
        self._regions = [_shared_region(pool) for pool in kv_caches]
        self.zero_copy = all(region is not None for region in self._regions)
        self._spare: list[Segment] = []  # staging segments to reuse (I/O thread only)
        if not self.zero_copy:
            logger.info("%s: KV pools are not in shared memory; each transfer is staged (one more copy)",
                        config.worker_name)

    def _read_layer(self, t: Outgoing, layer: int) -> tuple[str, int, list[int], bool]:
        if self.zero_copy:
            name, offset = self._regions[layer]
            return name, offset, t.spec.src_block_ids, False
        n, row_bytes = len(t.spec.src_block_ids), self.layout.block_bytes
        if t.resources is None:
            t.resources = self._staging(self.layout.num_layers * n * row_bytes)
        offset = layer * n * row_bytes  # staging: [layer][n rows]
        copy_rows(t.resources.address + offset, range(n), self.kv_caches[layer].data_ptr(),
                  t.spec.src_block_ids, row_bytes)
        return t.resources.name, offset, list(range(n)), True

    def _staging(self, nbytes: int) -> Segment:
        """A spare segment that fits, else a new one. NOTE: reused because a fresh one costs more than
        the copy itself (page allocation and faults on both sides); sizes are powers of two so they fit
        later transfers."""
        fits = [segment for segment in self._spare if segment.size >= nbytes]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            self._spare.remove(segment)
            return segment
        size = max(MIN_STAGING_BYTES, 1 << (nbytes - 1).bit_length())
        return Segment.create(segment_name(self.config.worker_name, "stage"), size)

    def _push_layer(self, t: Outgoing, layer: int, data: tuple[str, int, list[int], bool]) -> None:
        msg = ShmLayer(t.spec.request_id, layer, self.layout, self.ack_address, os.getpid(), *data)
        self.io.peer(t.spec.receiver).send(self.codec.encode(msg), zmq.NOBLOCK)

    def _release(self, t: Outgoing, receiver_done: bool) -> None:
        segment, t.resources = t.resources, None
        if segment is None:
            return
        if receiver_done:  # nothing will read it again: reuse it
            self._spare.append(segment)
            segment = None
            if len(self._spare) > MAX_SPARE_STAGING:
                segment = min(self._spare, key=lambda s: s.size)
                self._spare.remove(segment)
        if segment is not None:
            segment.unlink()
            segment.close()

    def close(self) -> None:
        super().close()  # the I/O thread has stopped: the spares are ours
        for segment in self._spare:
            segment.unlink()
            segment.close()
        self._spare.clear()


@dataclass
class _Mapping:
    segment: Segment
    pid: int  # its creator
    staging: bool
    last_used: float


class Receiver(ZmqReceiver):
    host = "127.0.0.1"
    decode_type = ShmLayer | SenderFailed

    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        _require_shm_dir()
        self._mappings: dict[str, _Mapping] = {}  # by segment name (names are never reused)
        self._live_pids: set[int] = set()  # senders seen alive, so worth watching
        self._next_check = 0.0
        super().__init__(config, layout, kv_caches)

    def _on_frames(self, frames: list[zmq.Frame]) -> tuple[Any, None] | None:
        if len(frames) != 1:
            logger.warning("%s KV receiver: refused a %d-part message", self.config.worker_name, len(frames))
            return None
        msg = self._decode_header(frames[0])
        return None if msg is None else (msg, None)

    def _write_layer(self, msg: ShmLayer, payload: None, st: Incoming) -> None:
        segment = self._segment(msg, st)
        row_bytes = self.layout.block_bytes
        if not 0 <= msg.offset <= segment.size or not rows_within(msg.rows, (segment.size - msg.offset) // row_bytes):
            raise ValueError(f"layer message points outside shared memory segment {msg.segment}")
        copy_rows(self.pool_address(msg.layer), st.dst_block_ids, segment.address + msg.offset, msg.rows, row_bytes)

    def _segment(self, msg: ShmLayer, st: Incoming) -> Segment:
        if st.resources is None:  # the sender's pid
            st.resources = msg.sender_pid
            if _alive(msg.sender_pid):  # else another pid namespace: rely on the deadline
                self._live_pids.add(msg.sender_pid)
        mapping = self._mappings.get(msg.segment)
        if mapping is None:
            try:
                segment = Segment.attach(msg.segment)
            except FileNotFoundError as exc:
                raise OSError(f"shared memory segment {msg.segment} is gone (did the prefill worker exit?)") from exc
            mapping = self._mappings[msg.segment] = _Mapping(segment, msg.sender_pid, msg.staging, 0.0)
        mapping.last_used = time.monotonic()
        return mapping.segment

    def _housekeep(self, failed: list[tuple[str, str]]) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + PID_CHECK_S
        for pid in [pid for pid in self._live_pids if not _alive(pid)]:
            self._live_pids.discard(pid)
            for request_id in [rid for rid, st in self._expected.items() if st.resources == pid]:
                self._fail(request_id, f"prefill worker process {pid} is gone", failed)
            self._unmap([name for name, m in self._mappings.items() if m.pid == pid])
        # a sender may have unlinked a staging segment; our mapping would keep its memory alive
        self._unmap([name for name, m in self._mappings.items() if m.staging and now - m.last_used > STAGING_IDLE_S])

    def _unmap(self, names: list[str]) -> None:
        for name in names:
            self._mappings.pop(name).segment.close()

    def close(self) -> None:
        super().close()
        self._unmap(list(self._mappings))

def _require_shm_dir() -> None:
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"the shm KV transport needs POSIX shared memory in {SHM_DIR} (Linux); use tcp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True
