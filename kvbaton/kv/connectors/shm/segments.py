"""POSIX shared-memory segments, created (and tracked for cleanup) or attached read-only by name, and
KV pools allocated in one, so shm receivers read their blocks in place."""

from __future__ import annotations

import itertools
import math
import mmap
import os
import re
from multiprocessing import resource_tracker

import numpy as np
import torch

from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools, torch_dtype

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory; segments are opened here by name
PAGE = 4096
_NAME_OK = re.compile(r"kvb-[A-Za-z0-9_.-]{1,200}")
_counter = itertools.count()


def segment_name(worker_name: str, kind: str) -> str:
    """Unique per worker, process and use, so test runs and workers never clash."""
    worker = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_name)[:64]
    return f"kvb-{worker}-{os.getpid()}-{kind}{next(_counter)}"


def require_shm_dir() -> None:
    if not os.path.isdir(SHM_DIR):
        raise RuntimeError(f"the shm KV transport needs POSIX shared memory in {SHM_DIR} (Linux); use tcp")


class Segment:
    """A mapped POSIX shared-memory segment; `address` is where its first byte is in this process."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name, self.mm, self.size, self.owner = name, mm, len(mm), owner
        view = np.frombuffer(mm, dtype=np.uint8)  # [size]; keeps the address valid while mapped
        self._view: np.ndarray | None = view
        self.address = view.ctypes.data

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        require_shm_dir()
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
    def attach(cls, name: str, writable: bool = False) -> Segment:
        """Map someone else's segment, read-only unless `writable` (and untracked: its creator owns the name).
        A writable attach also refuses a segment others than its owner may open (mode beyond 0600)."""
        if not _NAME_OK.fullmatch(name):
            raise ValueError(f"refusing shared memory segment name {name!r}")
        # NOTE: O_NOFOLLOW: a symlink planted under our name in the world-writable /dev/shm is refused
        fd = os.open(os.path.join(SHM_DIR, name), (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
        try:
            stat = os.fstat(fd)
            if stat.st_uid != os.getuid():
                # Another user's segment of our name would feed this worker KV of their choosing.
                raise PermissionError(f"refusing shared memory segment {name!r}: owned by uid {stat.st_uid}, "
                                      f"not this process's uid {os.getuid()}")
            if writable and stat.st_mode & 0o077:
                raise PermissionError(f"refusing shared memory segment {name!r}: mode {stat.st_mode & 0o777:o} "
                                      "lets others than its owner in")
            # NOTE: prot, not access=ACCESS_READ, so a PROT_READ mapping still exposes a buffer numpy
            # can take an address from; nothing here writes through it
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED, prot=prot)
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


class SharedPoolSegment:
    """The `SharedRegion` of pools from `allocate_shared_pools`: one segment, layer `i` at `i * stride`."""

    def __init__(self, segment: Segment, stride: int) -> None:
        self.segment, self.name, self._stride = segment, segment.name, stride

    def layer_offset(self, layer: int) -> int:
        return layer * self._stride

    def close(self) -> None:
        # NOTE: unlink only, no munmap: the tensors may outlive this call, and torch.frombuffer does
        # not pin the buffer, so closing the mmap would pull the memory from under them. The memory
        # goes with the last mapping: here when the tensors are garbage, in receivers when they unmap.
        self.segment.unlink()


def allocate_shared_pools(layout: KVLayout, num_blocks: int, name_prefix: str) -> KVPools:
    """Zeroed pools of `layout` in one shared-memory segment named after `name_prefix` (the worker
    name) and this pid; `.shared` says where. A shm `Sender` over them sends without copying:
    receivers read the blocks straight from it. `KVPools.close()` unlinks the name (at shutdown)."""
    shape = layout.pool_shape(num_blocks)
    numel = math.prod(shape)
    stride = -(-numel * layout.element_bytes // PAGE) * PAGE  # each layer page-aligned
    segment = Segment.create(segment_name(name_prefix, "pool"), stride * layout.num_layers)
    caches = [torch.frombuffer(segment.mm, dtype=torch_dtype(layout), count=numel, offset=i * stride).view(shape)
              for i in range(layout.num_layers)]
    return KVPools(layout, caches, SharedPoolSegment(segment, stride))
