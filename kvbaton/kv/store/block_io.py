"""Copies between a worker's pools and a block payload (the block's rows of every layer, layer
after layer): the only code of the store that touches the pools."""

from __future__ import annotations

import ctypes

import numpy as np

from kvbaton.kv.pools import KVPools


def buffer_address(view: memoryview) -> int:
    """Where `view`'s first byte lies (read-only buffers too: numpy takes their address without copying)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class BlockIO:
    def __init__(self, pools: KVPools) -> None:
        self.pools = pools
        self.block_bytes = pools.layout.block_bytes  # one block, one layer
        self.payload_bytes = pools.layout.bytes_per_block
        self._num_blocks = pools.num_blocks

    def gather(self, block_id: int, dst: memoryview) -> None:
        """Block `block_id` of every layer into `dst` (a payload)."""
        self._check(block_id, dst)
        base, n = buffer_address(dst), self.block_bytes
        for layer in range(self.pools.layout.num_layers):
            ctypes.memmove(base + layer * n, self.pools.address(layer) + block_id * n, n)

    def scatter(self, src: memoryview, block_id: int) -> None:
        """A payload into block `block_id` of every layer."""
        self._check(block_id, src)
        base, n = buffer_address(src), self.block_bytes
        for layer in range(self.pools.layout.num_layers):
            ctypes.memmove(self.pools.address(layer) + block_id * n, base + layer * n, n)

    def _check(self, block_id: int, payload: memoryview) -> None:
        # NOTE: raw addresses below, so the bounds are checked here, every time
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block {block_id} outside a pool of {self._num_blocks} blocks")
        if payload.nbytes != self.payload_bytes:
            raise ValueError(f"a payload of {payload.nbytes} bytes for blocks of {self.payload_bytes}")
