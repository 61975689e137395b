"""The tiers stacked over one worker's pools: what the scheduler asks at admission (`PrefixStore`),
and what the engine writes after a step (write-through) or before a block is reused (write-back).

    plan(hashes)  ->  for each block, the fastest tier that holds it; cut where loading is slower
                      than recomputing (`costs.LoadCosts`)
    load(...)     ->  block by block into the pool; a block from a slower tier is copied up into
                      the faster ones (promotion), so the next worker on the host finds it in shm
    start_load(...) / finished_loads()
                  ->  the same on the loader thread, while the engine steps the other requests
    save(...)     ->  each block into every tier (each tier decides whether it has it already)

Everything is best effort: a tier that fails is a miss, and the scheduler recomputes what did not load.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvbaton.kv.hashing import BlockHash
from kvbaton.kv.pools import KVPools
from kvbaton.kv.store.base import KVTier, LoadPlan, TierStats
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
        self._lock = threading.Lock()  # _loaded, costs and the counter: the loader thread updates them too
        self.num_loaded_blocks = 0
        # NOTE: one loader thread, started on first use: loads run in order, and the copies (ctypes memmoves and
        # tier reads, which release the GIL) overlap the engine's steps of the requests already running
        self._loader: ThreadPoolExecutor | None = None
        self._loads: dict[int, Future[int]] = {}
        self._tickets = itertools.count(1)

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

    def plan(self, block_hashes: Sequence[BlockHash]) -> LoadPlan:
        sources = self.sources(block_hashes) if block_hashes else []
        if not sources:
            return LoadPlan(0)
        with self._lock:
            n = self.costs.worth_loading(sources, self.block_size)
        return LoadPlan(n, any(not self.tiers[i].in_memory for i in sources[:n]))

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        for n, (block_hash, block_id) in enumerate(zip(block_hashes, block_ids)):
            if not self._load_one(block_hash, block_id):
                return n
        return min(len(block_hashes), len(block_ids))

    def start_load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """`load` on the loader thread; returns a ticket that `finished_loads` reports. The caller keeps the
        blocks out of every step (and out of the prefix-cache index) until then."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-load")
        ticket = next(self._tickets)
        self._loads[ticket] = self._loader.submit(self.load, list(block_hashes), list(block_ids))
        return ticket

    def finished_loads(self) -> list[tuple[int, int]]:
        """(ticket, blocks loaded) of the loads that ended since the last call; a load that raised loaded none
        of its blocks past where it stopped (the scheduler recomputes them)."""
        done = [(ticket, future) for ticket, future in self._loads.items() if future.done()]
        out = []
        for ticket, future in done:
            del self._loads[ticket]
            try:
                out.append((ticket, future.result()))
            except Exception:  # a bug in a tier: the blocks are recomputed, the engine goes on
                logger.exception("a KV store load failed")
                out.append((ticket, 0))
        return out

    def wait_for_load(self, timeout_s: float) -> None:
        """Block until some load ends (or `timeout_s`): for an engine with nothing else to step."""
        if self._loads:
            wait(list(self._loads.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _load_one(self, block_hash: BlockHash, block_id: int) -> bool:
        key = self.keys.key(block_hash)
        for i, tier in enumerate(self.tiers):
            start = time.perf_counter()
            hit = tier.get(key, lambda payload: self.io.scatter(payload, block_id))
            with self._lock:
                self.costs.note_load(i, time.perf_counter() - start)
            if hit:
                for faster in self.tiers[:i]:
                    faster.put(key, lambda dst: self.io.gather(block_id, dst))
                with self._lock:
                    if self.write_through:  # its save after this step would write it again
                        self._loaded.add(block_hash)
                    self.num_loaded_blocks += 1
                return True
        return False

    # ---- engine side ------------------------------------------------------------------------------

    def save(self, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        """Write these (hash, pool block) pairs into every tier; blocks this store just loaded are skipped."""
        with self._lock:
            loaded, self._loaded = self._loaded, set()
        for block_hash, block_id in blocks:
            if block_hash in loaded:
                continue
            key = self.keys.key(block_hash)
            for tier in self.tiers:
                tier.put(key, functools.partial(self._gather_into, block_id))

    def _gather_into(self, block_id: int, dst: memoryview) -> None:
        self.io.gather(block_id, dst)

    def save_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        """Write-back: the pool is about to reuse this cached block; keep its content in the tiers."""
        key = self.keys.key(block_hash)
        for tier in self.tiers:
            tier.put(key, lambda dst: self.io.gather(block_id, dst))

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        with self._lock:
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
        if self._loader is not None:
            self._loader.shutdown(wait=True)  # a load in progress writes into the pool: let it end first
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:  # a tier failing to close must not keep the others open
                logger.exception("closing the %s KV tier failed", tier.name)
