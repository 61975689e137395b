"""The pool of KV blocks: ref counts, the prefix-cache index, and the free-block order.

Free blocks are handed out in a documented order: blocks that hold no cached content
first, then cached blocks in least-recently-freed order (LRU eviction). A cached block that
is hit while free is taken out of the free order without losing its content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvbaton.kv.hashing import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and its content known


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[BlockHash, int], None] | None = None) -> None:
        self.num_blocks = num_blocks
        # KV store, write-back: told (hash, block id) before an evicted block is handed out, its content intact
        self.on_evict = on_evict
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[BlockHash, int] = {}  # content hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def take(self, num: int) -> list[KVBlock]:
        """Hand out `num` free blocks (caller checked `num_free_blocks`), evicting as needed."""
        if num > self.num_free_blocks:
            raise RuntimeError(f"asked for {num} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num):
            if self._free_uncached:
                block = self.blocks[self._free_uncached.popitem(last=False)[0]]
            else:
                block = self.blocks[self._free_cached.popitem(last=False)[0]]
                if self.on_evict is not None and block.block_hash is not None:
                    self.on_evict(block.block_hash, block.block_id)
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a reference to each block (prefix-cache hits), pulling free ones out of the free order."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_cached.pop(block.block_id)
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; the caller passes them tail first, so a
        request's later blocks are evicted before its (more shareable) prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            if block.ref_cnt == 0:
                queue = self._free_cached if block.block_hash is not None else self._free_uncached
                queue[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Record a full block's content hash so later requests can reuse it; False if it was not (caching
        off, the block named already, or the same content cached in another block, which is kept)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id
        return True

    def forget(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Take a block out of the prefix-cache index (its content never came to be); a free one becomes uncached."""
        if block.block_hash != block_hash:
            return
        if self._cached.get(block_hash) == block.block_id:
            del self._cached[block_hash]
        block.block_hash = None
        if block.block_id in self._free_cached:
            del self._free_cached[block.block_id]
            self._free_uncached[block.block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request uses; returns how many were dropped."""
        dropped = list(self._free_cached)
        for block_id in dropped:
            self._evict(self.blocks[block_id])
            self._free_uncached[block_id] = None
        self._free_cached.clear()
        return len(dropped)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        `expected_refs` (block id -> number of holders), when given, must equal ref counts.
        """
        free = set(self._free_uncached) | set(self._free_cached)
        assert not set(self._free_uncached) & set(self._free_cached), "block in both free queues"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id} free-state mismatch"
            if block.block_id in self._free_cached:
                assert block.block_hash is not None, f"uncached block {block.block_id} in cached queue"
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, f"block {block.block_id}: ref {block.ref_cnt}, held by {want}"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cache index stale for block {block_id}"
