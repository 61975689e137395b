"""The encoder cache's rule (`kvbaton/mm/encoder_cache.py`): an entry stays while a request holds it, whatever its
size; unheld, it stays only while the unheld entries fit the byte bound, least recently used out first."""

from __future__ import annotations

from kvbaton.mm.encoder_cache import EncoderCache


def test_a_held_entry_stays_whatever_the_bound_and_an_unheld_one_only_within_it():
    cache: EncoderCache[str] = EncoderCache(max_bytes=100)
    assert cache.acquire("r1", "a") is None  # a miss: the caller encodes
    cache.put("r1", "a", "A", 80)
    cache.put("r1", "b", "B", 80)  # 160 held bytes: over the bound, kept while held
    assert cache.acquire("r2", "a") == "A"
    cache.release("r1")  # b is unheld (80 <= 100): kept; a is still r2's
    assert "a" in cache and "b" in cache
    cache.release("r2")  # a unheld too: 160 > 100, the least recently released (b) goes
    assert "a" in cache and "b" not in cache
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.bytes, stats.entries) == (1, 1, 1, 80, 1)


def test_no_entry_outlives_its_last_user_beyond_the_bound():
    cache: EncoderCache[int] = EncoderCache(max_bytes=250)
    for i in range(40):
        request = f"r{i}"
        if cache.acquire(request, f"img{i % 7}") is None:
            cache.put(request, f"img{i % 7}", i, 100)
        assert cache.stats().bytes <= 250 + 100  # what no one holds, plus this request's own
        cache.release(request)
        assert cache.stats().bytes <= 250
    cache.release("never-seen")  # a request that held nothing: a no-op
    assert cache.stats().entries == 2


def test_a_zero_byte_bound_keeps_only_what_is_held_and_an_entry_held_twice_counts_once():
    cache: EncoderCache[str] = EncoderCache(max_bytes=0)
    cache.put("r1", "a", "A", 10)
    assert cache.acquire("r1", "a") == "A"  # the same request again: still one hold
    assert cache.acquire("r2", "a") == "A"
    cache.release("r1")
    assert "a" in cache
    cache.release("r2")
    assert "a" not in cache and cache.stats().bytes == 0
