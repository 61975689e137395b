"""KVCacheManager: chained block hashes, prefix-cache hits, all-or-nothing allocation,
tail-first freeing and slot accounting; every scenario ends with check_integrity()."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvbaton.kv.hashing import hash_block_tokens
from kvbaton.sched.kv_cache_manager import KVCacheManager
from kvbaton.sched.request import Request
from kvbaton.sched.sampling_params import SamplingParams

BS = 4  # block size


def make_req(request_id: str, prompt: list[int] | range) -> Request:
    return Request(request_id, list(prompt), SamplingParams())


@pytest.fixture
def make_kv() -> Iterator[Callable[..., KVCacheManager]]:
    made: list[KVCacheManager] = []

    def make(num_blocks: int = 16, enable_caching: bool = True) -> KVCacheManager:
        made.append(KVCacheManager(num_blocks, BS, enable_caching))
        return made[-1]

    yield make
    for kv in made:
        kv.check_integrity()


def prefill(kv: KVCacheManager, req: Request) -> None:
    """Admit `req` the way the scheduler does: prefix hits, then slots for the rest."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = req.num_tokens


def test_hash_block_tokens_is_chained_and_stable() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    # pinned values: the hash must not depend on the process (PYTHONHASHSEED) or the platform
    assert root.hex() == "05ca62eedbcbca52c72437aa6f79308e"
    assert child.hex() == "fdebc41c4ef38fcfb88050465bce7eb1"
    assert hash_block_tokens(None, [1, 2, 3, 4]) == root
    assert hash_block_tokens(None, [5, 6, 7, 8]) != child  # same tokens, other parent
    assert hash_block_tokens(root, [5, 6, 7, 9]) != child
    assert hash_block_tokens(None, [4, 3, 2, 1]) != root


def test_get_computed_blocks_returns_the_longest_cached_prefix(make_kv) -> None:
    kv = make_kv()
    a = make_req("a", range(13))  # three full blocks + one token
    assert kv.get_computed_blocks(a) == ([], 0)
    prefill(kv, a)
    b = make_req("b", [*range(8), 99, 98, 97, 96, 5])  # shares two blocks, diverges in the third
    hits, num_hit = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2] and num_hit == 8
    c = make_req("c", [7, *range(1, 13)])  # differs in the first token: nothing is shared
    assert kv.get_computed_blocks(c) == ([], 0)
    kv.free(a)
    hits, num_hit = kv.get_computed_blocks(make_req("d", range(20)))  # hits survive free()
    assert [h.block_id for h in hits] == [0, 1, 2] and num_hit == 12


@pytest.mark.parametrize(("prompt_len", "want_hit"), [(4, 0), (5, 4), (12, 8), (13, 12), (16, 12)])
def test_get_computed_blocks_leaves_at_least_one_token_to_compute(make_kv, prompt_len: int, want_hit: int) -> None:
    kv = make_kv()
    prefill(kv, make_req("a", range(16)))
    hits, num_hit = kv.get_computed_blocks(make_req("b", range(prompt_len)))
    assert num_hit == want_hit == len(hits) * BS


def test_no_hits_when_caching_is_disabled(make_kv) -> None:
    kv = make_kv(enable_caching=False)
    prefill(kv, make_req("a", range(12)))
    assert kv.get_computed_blocks(make_req("b", range(12))) == ([], 0)
    assert all(b.block_hash is None for b in kv.pool.blocks)


def test_hit_blocks_are_shared_not_copied(make_kv) -> None:
    kv = make_kv()
    a, b = make_req("a", range(10)), make_req("b", [*range(8), 50, 51, 52])
    prefill(kv, a)
    prefill(kv, b)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert len(set(kv.block_ids("a") + kv.block_ids("b"))) == 4
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [2, 2, 1]
    assert kv.prefix_cache_stats().queried_tokens == 0  # only the scheduler records lookups
    kv.record_lookup(11, 8)
    assert kv.prefix_cache_stats().hit_rate == pytest.approx(8 / 11)


def test_allocate_slots_fails_without_changes_when_the_pool_is_short(make_kv) -> None:
    kv = make_kv(num_blocks=4)
    a = make_req("a", range(12))
    prefill(kv, a)
    before = kv.block_ids("a")
    assert not kv.allocate_slots(make_req("b", range(100, 108)), 8)  # needs 2 blocks, 1 free
    assert "b" not in kv.req_blocks and kv.pool.num_free_blocks == 1
    a.output_token_ids.append(1)
    assert not kv.allocate_slots(a, 5)  # a running request that would need 2 more blocks
    assert kv.block_ids("a") == before and kv.pool.num_free_blocks == 1
    assert kv.allocate_slots(a, 1) and len(kv.block_ids("a")) == 4


def test_free_cached_hits_count_against_the_free_pool(make_kv) -> None:
    kv = make_kv(num_blocks=4)
    a = make_req("a", range(9))  # blocks 0, 1 full (cached), block 2 partial
    prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    big = make_req("big", range(17))  # 2 hit blocks + 3 new = 5 > 4 blocks
    hits, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8
    assert not kv.allocate_slots(big, 17 - num_hit, hits)
    assert "big" not in kv.req_blocks and kv.pool.num_free_blocks == 4
    assert all(h.ref_cnt == 0 and kv.pool.lookup(h.block_hash) is h for h in hits)
    fits = make_req("fits", range(16))  # 2 hit blocks + 2 new = 4
    hits, num_hit = kv.get_computed_blocks(fits)
    assert kv.allocate_slots(fits, 16 - num_hit, hits)
    assert kv.block_ids("fits")[:2] == [0, 1] and kv.pool.num_free_blocks == 0


def test_free_releases_everything_tail_first(make_kv) -> None:
    kv = make_kv(num_blocks=3)
    a = make_req("a", range(12))
    prefill(kv, a)
    held = kv.req_blocks["a"]
    kv.free(a)
    assert kv.usage() == 0.0 and kv.block_ids("a") == [] and "a" not in kv.req_blocks
    assert all(b.ref_cnt == 0 for b in held)
    # the tail is evicted first, so the shareable prefix survives longest
    assert [b.block_id for b in kv.pool.take(2)] == [held[2].block_id, held[1].block_id]
    assert kv.pool.lookup(a.block_hashes[0]) is held[0] and kv.pool.lookup(a.block_hashes[2]) is None
    kv.pool.release(held[1:])
    kv.free(a)  # freeing twice is harmless
    kv.free(make_req("never", [1]))


def test_decode_growth_takes_blocks_on_demand_and_caches_full_ones(make_kv) -> None:
    kv = make_kv()
    req = make_req("a", range(6))
    prefill(kv, req)
    assert len(kv.block_ids("a")) == 2 and len(req.block_hashes) == 1
    for token in (6, 7, 8):
        req.output_token_ids.append(token)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert len(kv.block_ids("a")) == 3 and len(req.block_hashes) == 2  # 9 tokens: blocks 0, 1 full
    assert kv.pool.lookup(req.block_hashes[1]) is kv.req_blocks["a"][1]
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [4, 5, 6, 7])


def test_slot_waste_counts_shared_blocks_once(make_kv) -> None:
    kv = make_kv()
    a = make_req("a", range(9))
    prefill(kv, a)
    assert kv.slot_waste([a]) == (12, 9)
    b = make_req("b", [*range(8), 42])
    prefill(kv, b)
    assert kv.slot_waste([a, b]) == (16, 10)
    b.num_computed_tokens = 8  # b's third block is allocated but not yet filled
    assert kv.slot_waste([a, b]) == (16, 9)


def test_check_integrity_catches_a_reference_no_request_holds(make_kv) -> None:
    kv = make_kv()
    a = make_req("a", range(8))
    prefill(kv, a)
    kv.pool.touch(kv.req_blocks["a"][:1])  # a leaked reference
    with pytest.raises(AssertionError, match="block 0: ref 2, held by 1"):
        kv.check_integrity()
    kv.pool.release(kv.req_blocks["a"][:1])
