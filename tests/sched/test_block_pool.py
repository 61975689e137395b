"""BlockPool: ref counts, the documented free order (uncached first, then cached LRU),
the prefix-cache index, and check_integrity catching corrupted bookkeeping."""

from __future__ import annotations

import pytest

from kvbaton.sched.block_pool import BlockPool, KVBlock


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def cached_pool(num_blocks: int, hashed: dict[int, bytes]) -> tuple[BlockPool, list[KVBlock]]:
    """A pool with every block taken once and `hashed` (block id -> hash) cached."""
    pool = BlockPool(num_blocks)
    blocks = pool.take(num_blocks)
    for block_id, block_hash in hashed.items():
        pool.cache(blocks[block_id], block_hash)
    return pool, blocks


def test_take_touch_release_track_ref_counts() -> None:
    pool = BlockPool(4)
    a = pool.take(2)
    assert ids(a) == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 2 and pool.usage() == 0.5
    pool.touch(a)  # a second holder shares them
    pool.check_integrity({0: 2, 1: 2})
    pool.release(a)
    pool.check_integrity({0: 1, 1: 1})
    assert pool.num_free_blocks == 2
    pool.release(a)
    pool.check_integrity({})
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0


def test_take_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.take(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.take(2)
    pool.check_integrity({0: 1, 1: 1})


def test_over_release_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.take(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="block 0 released more often than taken"):
        pool.release(blocks)


def test_uncached_blocks_are_handed_out_before_cached_ones() -> None:
    pool, blocks = cached_pool(4, {0: b"h0", 1: b"h1"})
    pool.release(blocks[::-1])  # a request's blocks come back tail first: 3, 2, 1, 0
    pool.check_integrity({})
    assert ids(pool.take(2)) == [3, 2]  # uncached, in the order they were freed
    assert pool.num_evictions == 0 and pool.lookup(b"h0") is blocks[0]
    assert ids(pool.take(1)) == [1]  # then cached, least recently freed first
    assert pool.num_evictions == 1 and pool.lookup(b"h1") is None
    assert blocks[1].block_hash is None
    assert pool.lookup(b"h0") is blocks[0]


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool, blocks = cached_pool(4, {i: f"h{i}".encode() for i in range(4)})
    pool.release([blocks[3], blocks[2]])  # request B finishes first, tail first
    pool.release([blocks[1], blocks[0]])  # then request A
    assert ids(pool.take(3)) == [3, 2, 1]
    assert [pool.lookup(f"h{i}".encode()) for i in range(4)] == [blocks[0], None, None, None]
    assert pool.num_evictions == 3
    pool.check_integrity({1: 1, 2: 1, 3: 1})


def test_cache_and_lookup() -> None:
    pool, blocks = cached_pool(3, {0: b"x"})
    assert pool.lookup(b"x") is blocks[0] and blocks[0].block_hash == b"x"
    assert pool.lookup(b"y") is None
    pool.cache(blocks[1], b"x")  # same content elsewhere: the first copy stays the cached one
    assert pool.lookup(b"x") is blocks[0] and blocks[1].block_hash is None
    pool.cache(blocks[0], b"z")  # a block's content never changes once hashed
    assert blocks[0].block_hash == b"x" and pool.lookup(b"z") is None
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_cache_is_a_no_op_when_caching_is_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    block = pool.take(1)[0]
    pool.cache(block, b"x")
    assert pool.lookup(b"x") is None and block.block_hash is None
    pool.release([block])
    pool.check_integrity({})


def test_touch_of_a_free_cached_block_takes_it_out_of_the_free_order() -> None:
    pool, blocks = cached_pool(3, {0: b"h0"})
    pool.release(blocks[::-1])
    hit = pool.lookup(b"h0")
    assert hit is blocks[0]
    pool.touch([hit])  # a prefix-cache hit revives the block with its content
    assert hit.ref_cnt == 1 and hit.block_hash == b"h0"
    assert pool.num_free_blocks == 2
    pool.check_integrity({0: 1})
    assert ids(pool.take(2)) == [2, 1]  # the hit block is never handed out again
    with pytest.raises(RuntimeError):
        pool.take(1)
    assert pool.num_evictions == 0 and pool.lookup(b"h0") is hit


def test_reset_prefix_cache_drops_only_unused_cached_blocks() -> None:
    pool, blocks = cached_pool(3, {0: b"h0", 1: b"h1"})
    pool.release([blocks[1]])  # h1 is free, h0 is still in use
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"h1") is None and blocks[1].block_hash is None
    assert pool.lookup(b"h0") is blocks[0]
    pool.check_integrity({0: 1, 2: 1})
    assert pool.reset_prefix_cache() == 0
    pool.release([blocks[2], blocks[0]])
    assert ids(pool.take(3)) == [1, 2, 0]  # block 1 became uncached again; h0 evicted last
    assert pool.lookup(b"h0") is None


def _wrong_refs(pool: BlockPool, blocks: list[KVBlock]) -> dict[int, int]:
    return {0: 2, 1: 1}


def _ref_without_leaving_free_order(pool: BlockPool, blocks: list[KVBlock]) -> dict[int, int]:
    pool.blocks[3].ref_cnt = 1
    return {0: 1, 1: 1, 3: 1}


def _in_both_free_queues(pool: BlockPool, blocks: list[KVBlock]) -> dict[int, int]:
    pool.release([blocks[0]])  # cached, so it is queued in the cached free order
    pool._free_uncached[0] = None
    return {1: 1}


def _stale_cache_index(pool: BlockPool, blocks: list[KVBlock]) -> dict[int, int]:
    blocks[0].block_hash = b"other"
    return {0: 1, 1: 1}


def _uncached_block_in_cached_queue(pool: BlockPool, blocks: list[KVBlock]) -> dict[int, int]:
    pool._free_cached[pool._free_uncached.popitem()[0]] = None
    return {0: 1, 1: 1}


def _negative_ref(pool: BlockPool, blocks: list[KVBlock]) -> dict[int, int]:
    blocks[1].ref_cnt = -1
    return {0: 1}


@pytest.mark.parametrize(("corrupt", "message"), [
    (_wrong_refs, "block 0: ref 1, held by 2"),
    (_ref_without_leaving_free_order, "block 3 free-state mismatch"),
    (_in_both_free_queues, "block in both free queues"),
    (_stale_cache_index, "cache index stale for block 0"),
    (_uncached_block_in_cached_queue, "uncached block 3 in cached queue"),
    (_negative_ref, "block 1 has negative ref count"),
])
def test_check_integrity_catches_corruption(corrupt, message: str) -> None:
    pool = BlockPool(4)
    blocks = pool.take(2)
    pool.cache(blocks[0], b"h0")
    pool.check_integrity({0: 1, 1: 1})
    expected_refs = corrupt(pool, blocks)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity(expected_refs)
