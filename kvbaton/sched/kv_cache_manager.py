"""Per-request block tables on top of the block pool, with automatic prefix caching.

A full block is named by its content address (`kvbaton.kv.hashing`: a hash chained from its
parent's hash and its own token ids), so equal hashes mean equal prefixes; a new request reuses
the longest run of cached blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbaton.kv.hashing import BlockHash, hash_block_tokens, salted_root
from kvbaton.sched.block_pool import BlockPool, KVBlock
from kvbaton.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 on_evict: Callable[[BlockHash, int], None] | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, on_evict)
        # Blocks indexed since the last drain, full once the step has run: the KV store writes them through, and a
        # step that raises un-indexes them (their KV never came to be)
        self._new_blocks: list[tuple[BlockHash, int]] = []
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # blocks of a request already in the cache index
        self._queried_tokens = 0
        self._hit_tokens = 0

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `req`; at least one token is always left to compute,
        because the last prompt token's logits are needed to sample. None for a request that asks for
        its prompt's logprobs: every prompt token's logits are needed, and a cached block has none."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits: list[KVBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix lookup in the hit-rate statistics."""
        self._queried_tokens += num_tokens
        self._hit_tokens += num_hit_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None, index_blocks: bool = True) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after any prefix-cache hits).

        Returns False, changing nothing, when the pool cannot supply the blocks. With
        `index_blocks=False` the new blocks stay out of the prefix-cache index (their content
        is still to arrive from another worker; see `index_computed_blocks`).
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(hits)
        # NOTE: a free cached hit leaves the free pool when touched, so it counts against it.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        self.pool.touch(hits)
        blocks.extend(hits)
        if num_needed > 0:
            blocks.extend(self.pool.take(num_needed))
        if index_blocks:
            self._cache_full_blocks(req, blocks, min(num_total, req.num_tokens))
        return True

    def index_computed_blocks(self, req: Request, num_tokens: int) -> None:
        """Put the request's full blocks among its first `num_tokens` into the prefix-cache index."""
        self._cache_full_blocks(req, self.req_blocks.get(req.request_id, []), num_tokens)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self._num_hashed_blocks.pop(req.request_id, None)
        self.pool.release(list(reversed(blocks)))

    def drain_new_blocks(self) -> list[tuple[BlockHash, int]]:
        """(hash, block id) of the blocks indexed since the last call: after a step, their KV is computed."""
        if not self._new_blocks:
            return []
        out, self._new_blocks = self._new_blocks, []
        return out

    def forget_new_blocks(self) -> None:
        """The step that was to compute the blocks indexed since the last drain raised: take them out of the
        prefix-cache index, so no later request hits KV that was never (or only partly) computed."""
        for block_hash, block_id in self.drain_new_blocks():
            self.pool.forget(self.pool.blocks[block_id], block_hash)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def usage(self) -> float:
        return self.pool.usage()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queried_tokens, self._hit_tokens)

    def slot_waste(self, requests: list[Request]) -> tuple[int, int]:
        """(allocated slots, filled slots) over distinct blocks held by `requests`."""
        filled: dict[int, int] = {}
        for req in requests:
            for i, block in enumerate(self.req_blocks.get(req.request_id, [])):
                n = min(max(req.num_computed_tokens - i * self.block_size, 0), self.block_size)
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return len(filled) * self.block_size, sum(filled.values())

    def check_integrity(self) -> None:
        """Pool bookkeeping is consistent and every reference is held by a live request."""
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        self.pool.check_integrity(refs)

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[i - 1] if i else salted_root(req.sampling_params.cache_salt)
            req.block_hashes.append(hash_block_tokens(parent, req.token_slice(i * bs, (i + 1) * bs),
                                                         req.image_digests(i * bs, (i + 1) * bs)))

    def _cache_full_blocks(self, req: Request, blocks: list[KVBlock], num_known_tokens: int) -> None:
        """Index blocks that will be full of known tokens once this step has run."""
        if not self.enable_caching:
            return
        num_full = min(num_known_tokens // self.block_size, len(blocks))
        start = self._num_hashed_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(req, num_full)
        for i in range(start, num_full):
            if self.pool.cache(blocks[i], req.block_hashes[i]):
                self._new_blocks.append((req.block_hashes[i], blocks[i].block_id))
        self._num_hashed_blocks[req.request_id] = num_full
