"""The tiers stacked over one worker's pools: what the scheduler asks at admission (`PrefixStore`),
and what the engine writes after a step (write-through) or before a block is reused (write-back).

    plan(hashes)  ->  for each block, the fastest tier that holds it; cut where loading is slower
                      than recomputing (`costs.LoadCosts`)
    load(...)     ->  block by block into the pool; a block from a slower tier is copied up into
                      the faster ones (promotion), so the next worker on the host finds it in shm
    save(...)     ->  each block into every tier (each tier decides whether it has it already)

Everything is best effort: a tier that fails is a miss, and the scheduler recomputes what did not load.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

from kvbaton.kv.hashing import BlockHash
from kvbaton.kv.pools import KVPools
from kvbaton.kv.store.base import KVTier, TierStats
from kvbaton.kv.store.block_io import BlockIO
from kvbaton.kv.store.costs import LoadCosts
from kvbaton.kv.store.keys import StoreKeys

logger = logging.getLogger(__name__)


class TieredStore:
    def __init__(self, tiers: list[KVTier], keys: StoreKeys, pools: KVPools, write_through: bool = True) -> None:
        self.tiers, self.keys = tiers, keys
        self.write_through = write_through
        self.io = BlockIO(pools)
        self.block_size = pools.layout.block_size
        self.costs = LoadCosts(len(tiers))
        self._loaded: set[BlockHash] = set()  # loaded since the last save: already stored, not written again
        self.num_loaded_blocks = 0

    # ---- scheduler side (PrefixStore) -------------------------------------------------------------

    def sources(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Per leading block, the index of the fastest tier holding it (stops at the first no tier holds)."""
        keys = self.keys.keys(block_hashes)
        found: list[int] = []
        while len(found) < len(keys):
            start = len(found)
            for i, tier in enumerate(self.tiers):
                n = tier.contains(keys[start:])
                if n:
                    found += [i] * n
                    break
            if len(found) == start:
                break
        return found

    def plan(self, block_hashes: Sequence[BlockHash]) -> int:
        if not block_hashes:
            return 0
        sources = self.sources(block_hashes)
        return self.costs.worth_loading(sources, self.block_size) if sources else 0

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        for n, (block_hash, block_id) in enumerate(zip(block_hashes, block_ids)):
            if not self._load_one(block_hash, block_id):
                return n
        return min(len(block_hashes), len(block_ids))

    def _load_one(self, block_hash: BlockHash, block_id: int) -> bool:
        key = self.keys.key(block_hash)
        for i, tier in enumerate(self.tiers):
            start = time.perf_counter()
            hit = tier.get(key, lambda payload: self.io.scatter(payload, block_id))
            self.costs.note_load(i, time.perf_counter() - start)
            if hit:
                for faster in self.tiers[:i]:
                    faster.put(key, lambda dst: self.io.gather(block_id, dst))
                if self.write_through:  # its save after this step would write it again
                    self._loaded.add(block_hash)
                self.num_loaded_blocks += 1
                return True
        return False

    # ---- engine side ------------------------------------------------------------------------------

    def save(self, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        """Write these (hash, pool block) pairs into every tier; blocks this store just loaded are skipped."""
        for block_hash, block_id in blocks:
            if block_hash in self._loaded:
                continue
            key = self.keys.key(block_hash)
            for tier in self.tiers:
                tier.put(key, functools.partial(self._gather_into, block_id))
        self._loaded.clear()

    def _gather_into(self, block_id: int, dst: memoryview) -> None:
        self.io.gather(block_id, dst)

    def save_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        """Write-back: the pool is about to reuse this cached block; keep its content in the tiers."""
        key = self.keys.key(block_hash)
        for tier in self.tiers:
            tier.put(key, lambda dst: self.io.gather(block_id, dst))

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        self.costs.note_prefill(num_tokens, seconds)

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]

    def flush(self, timeout_s: float = 5.0) -> None:
        for tier in self.tiers:
            tier.flush(timeout_s)

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def close(self) -> None:
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:  # a tier failing to close must not keep the others open
                logger.exception("closing the %s KV tier failed", tier.name)
