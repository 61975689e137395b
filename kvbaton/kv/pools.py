"""One worker's KV pools: per layer, one tensor of `layout.pool_shape(num_blocks)`.

The engine computes into `caches`; the KV transports read and write whole blocks of them. A pool
set may live in shared memory (`shared` is then set), so a transport on the same host can read
its blocks in place instead of copying them out first.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvbaton.kv.layout import KVLayout

# Quantized pools hold raw bytes: int8 codes in an int8 tensor, fp8 codes in a uint8 one (torch's float8 type
# has no index_copy_ on CPU), so the pool's tensor type alone says how to read it.
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return _STORAGE.get(layout.dtype) or getattr(torch, layout.dtype)


def block_view(kv_cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """One layer's pool as [num_blocks, block_numel]: row b is block b, contiguous."""
    return kv_cache.view(-1, layout.block_numel)


def check_pool(kv_cache: torch.Tensor, layout: KVLayout) -> None:
    """Raise ValueError unless `kv_cache` is a contiguous pool of `layout` (any number of blocks)."""
    if not kv_cache.is_contiguous() or kv_cache.dtype != torch_dtype(layout):
        raise ValueError("KV pools must be contiguous tensors of the layout's dtype")
    if tuple(kv_cache.shape[1:]) != layout.slot_shape or kv_cache.shape[0] % layout.block_size:
        raise ValueError(f"KV pool of shape {tuple(kv_cache.shape)} is not a pool of slots {layout.slot_shape} "
                         f"in blocks of {layout.block_size}")


class SharedRegion(Protocol):
    """Where a pool set lies in shared memory, for transports that read it from other processes."""

    name: str  # the segment's name

    def layer_offset(self, layer: int) -> int:
        """Byte offset of layer `layer`'s pool in the segment."""
        ...

    def close(self) -> None:
        """Give the segment's name back (the memory goes with its last mapping)."""
        ...


@dataclass
class KVPools:
    layout: KVLayout
    caches: list[torch.Tensor]  # [num_layers] x layout.pool_shape(num_blocks)
    shared: SharedRegion | None = None
    _closed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.caches) != self.layout.num_layers:
            raise ValueError(f"{len(self.caches)} pools for a layout of {self.layout.num_layers} layers")
        for cache in self.caches:
            check_pool(cache, self.layout)

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[0] // self.layout.block_size

    def blocks(self, layer: int) -> torch.Tensor:
        """Layer `layer` as [num_blocks, block_numel]: row b is block b."""
        return block_view(self.caches[layer], self.layout)

    def address(self, layer: int) -> int:
        return self.caches[layer].data_ptr()

    def prefault(self) -> bool:
        """Back every page of the pools with memory now, without writing to them (Linux's MADV_POPULATE_WRITE),
        so a server's memory is taken once, shortly after its start, rather than block by block under load.
        Safe while the engine computes into the pools. False where the kernel cannot (before Linux 5.14)."""
        return all(_populate(cache) for cache in self.caches)

    def close(self) -> None:
        """Release a shared segment's name (idempotent); plain pools are freed with their tensors."""
        if self.shared is not None and not self._closed:
            self.shared.close()
        self._closed = True


# (layout, num_blocks) -> pools; e.g. in shared memory, for the shm transport's senders
PoolAllocator = Callable[[KVLayout, int], KVPools]


def allocate_pools(layout: KVLayout, num_blocks: int) -> KVPools:
    """Zeroed pools in this process's own memory."""
    caches = [lazily_zeroed(layout.pool_shape(num_blocks), torch_dtype(layout)) for _ in range(layout.num_layers)]
    return KVPools(layout, caches)


_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python 3.11's mmap module does not name it
_PAGE = mmap.PAGESIZE


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc


def _populate(tensor: torch.Tensor, chunk: int = 64 * 2**20) -> bool:
    """NOTE: in chunks, each its own call: ctypes lets go of the GIL for each, and a stop between them is cheap."""
    if sys.platform != "linux":
        return False
    start = tensor.data_ptr() // _PAGE * _PAGE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    for at in range(start, end, chunk):
        if _libc().madvise(at, min(chunk, end - at), _MADV_POPULATE_WRITE) != 0:
            return False
    return True


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose pages the kernel zeroes when first touched.

    NOTE: `torch.zeros` writes every byte up front: a 1 GiB KV pool cost a worker ~0.5-2.8 s of its start
    (measured on 2 cores). numpy's zeros is `calloc`, which takes a large block as fresh anonymous pages, already
    zero; the tensor shares (and keeps alive) numpy's buffer. A served worker takes the pages in the background
    once it serves (`KVPools.prefault`), so its memory does not grow under load."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
