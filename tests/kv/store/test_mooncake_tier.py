"""The mooncake tier over a real private Mooncake Store (mooncake_master + the process holding its memory): a
block written by one client is read by another after the writer has gone, expiry, a corrupt object, and a store
killed mid-run (misses and a breaker, never an exception or a hang)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

from kvbaton.kv.store.keys import KEY_BYTES
from kvbaton.kv.store.mooncake_store import start_mooncake_store
from kvbaton.kv.store.mooncake_tier import PREFIX, MooncakeTier

PAYLOAD = 64 * 1024


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=KEY_BYTES).digest()


def payload(i: int) -> bytes:
    return bytes([i % 251]) * PAYLOAD


def put(tier: MooncakeTier, i: int) -> bool:
    return tier.put(key(i), lambda dst: dst.__setitem__(slice(None), payload(i)))


def get(tier: MooncakeTier, i: int) -> bytes | None:
    out: list[bytes] = []
    return out[0] if tier.get(key(i), lambda src: out.append(bytes(src))) else None


@pytest.fixture
def store():
    s = start_mooncake_store(64 * 2**20)
    yield s
    s.stop()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in s.pids), "a Mooncake process outlived stop()"


def tier_of(store, ttl_s: float = 60.0) -> MooncakeTier:
    return MooncakeTier(store.master, store.metadata_url, PAYLOAD, ttl_s)


def test_blocks_outlive_the_worker_that_wrote_them(store):
    writer = tier_of(store)
    assert all(put(writer, i) for i in range(8))
    assert writer.contains([key(i) for i in [0, 1, 2, 99, 3]]) == 3
    writer.close()  # a worker gone: its blocks stay, in the store's own process
    reader = tier_of(store)
    assert [get(reader, i) for i in range(8)] == [payload(i) for i in range(8)]
    assert get(reader, 99) is None
    s = reader.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt) == (8, 1, 0, 0) and s.shared
    reader.close()


def test_an_expired_block_is_a_miss_and_is_removed(store):
    tier = tier_of(store, ttl_s=0.2)
    assert put(tier, 1)
    assert get(tier, 1) == payload(1)
    time.sleep(0.3)
    assert get(tier, 1) is None and tier.contains([key(1)]) == 0
    assert tier.stats().expirations == 1
    tier.close()


def test_a_corrupt_object_is_a_miss_counted_and_dropped(store):
    tier = tier_of(store)
    assert put(tier, 5)
    name = PREFIX + key(5).hex()
    value = bytearray(tier._client.get(name))
    value[-1] ^= 0xFF
    tier._client.remove(name, True)
    assert tier._client.put(name, bytes(value)) == 0
    assert get(tier, 5) is None
    assert tier.stats().corrupt == 1 and tier.contains([key(5)]) == 0
    assert put(tier, 5) and get(tier, 5) == payload(5)  # written again, whole
    tier.close()


def test_a_killed_store_costs_misses_and_opens_the_breaker(store):
    tier = tier_of(store)
    assert put(tier, 1)
    for pid in store.pids:
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    results = [get(tier, 1), tier.contains([key(1)]), put(tier, 2), get(tier, 2)]
    assert results == [None, 0, False, None]
    assert time.monotonic() - start < 3.0  # bounded: a call given up after 0.5 s, then the breaker skips the tier
    assert tier.stats().errors >= 1
    tier.close()


def test_calls_from_several_threads_take_turns(store):
    """The engine thread saves while the loader thread reads: no call fails for the other's sake."""
    import threading

    tier = tier_of(store)
    assert all(put(tier, i) for i in range(16))
    failures: list[str] = []

    def reader() -> None:
        for _ in range(5):
            failures.extend(f"get {i}" for i in range(16) if get(tier, i) != payload(i))

    def writer() -> None:
        for n in range(5):
            failures.extend(f"put {i}" for i in range(100 + 16 * n, 116 + 16 * n) if not put(tier, i))

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and tier.stats().errors == 0
    tier.close()
