"""The L4 Redis tier against real, private redis-servers (started here, stopped by PID): roundtrip,
TTL, corruption, a killed and a stalled server behind the circuit breaker, and allkeys-lru capacity."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import redis

from kvbaton.kv.redis_server import RedisServer, redis_server_binary, start_redis_server
from kvbaton.kv.store.keys import KEY_BYTES, key_text
from kvbaton.kv.store.redis_tier import RedisTier

# NOTE: no skip: scripts/setup.sh installs redis-server, so its absence is a set-up failure to see.
assert redis_server_binary() is not None, "redis-server is not installed (scripts/setup.sh installs it with apt-get)"

PAYLOAD = 4096
PREFIX = "kvb:kv:"


@pytest.fixture
def tiers():
    """make(url, **options) -> RedisTier; each is integrity-checked and closed after the test."""
    made: list[RedisTier] = []

    def make(url: str, payload_bytes: int = PAYLOAD, ttl_s: float = 30.0, **options) -> RedisTier:
        made.append(RedisTier(url, payload_bytes, ttl_s, **options))
        return made[-1]

    yield make
    for tier in made:
        tier.check_integrity()
        start = time.monotonic()
        tier.close()
        assert time.monotonic() - start < 6.0, "close() took too long"


@pytest.fixture
def own_servers():
    """start(**options) -> a server of this test alone (to kill, stop or fill); always resumed and reaped."""
    started: list[RedisServer] = []

    def start(**options) -> RedisServer:
        started.append(start_redis_server(**options))
        return started[-1]

    yield start
    for srv in started:
        try:
            os.kill(srv.pid, signal.SIGCONT)  # a SIGSTOPped server would sit on its SIGTERM
        except ProcessLookupError:
            pass
        srv.stop()
        assert not os.path.exists(f"/proc/{srv.pid}"), "redis-server outlived stop()"


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def payload(seed: int, n: int = PAYLOAD) -> bytes:
    return random.Random(seed).randbytes(n)


def filler(data: bytes, calls: list[int] | None = None):
    def fill(view: memoryview) -> None:
        if calls is not None:
            calls.append(1)
        view[:] = data

    return fill


def read(tier: RedisTier, key: bytes) -> bytes | None:
    got: list[bytes] = []
    return got[0] if tier.get(key, lambda view: got.append(bytes(view))) else None


def timed(call) -> tuple[object, float]:
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def test_roundtrip_contains_and_ttl_on_every_block(server, store, tiers):
    tier = tiers(server.url, ttl_s=30.0)
    keys = [new_key() for _ in range(4)]
    for i, key in enumerate(keys[:3]):
        assert tier.put(key, filler(payload(i)))
    tier.flush()

    for i, key in enumerate(keys[:3]):
        assert read(tier, key) == payload(i)
    assert tier.contains(keys) == 3
    assert tier.contains([keys[3], *keys[:3]]) == 0  # leading keys only
    assert tier.contains([]) == 0
    for key in keys[:3]:
        assert 0 < store.pttl(PREFIX + key_text(key)) <= 30_000
    s = tier.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt, s.dropped_writes) == (3, 0, 0, 0, 0)
    assert s.bytes_read == s.bytes_written == 3 * PAYLOAD and s.blocks == 3 and s.read_bandwidth > 0


def test_absent_key_is_a_miss(server, tiers):
    tier = tiers(server.url)
    assert read(tier, new_key()) is None
    s = tier.stats()
    assert (s.hits, s.misses, s.errors) == (0, 1, 0)


def test_put_of_a_present_key_overwrites_it_and_restarts_its_ttl(server, store, tiers):
    tier = tiers(server.url, ttl_s=30.0)
    key = new_key()
    tier.put(key, filler(payload(1)))
    tier.flush()
    store.pexpire(PREFIX + key_text(key), 5_000)
    tier.put(key, filler(payload(2)))
    tier.flush()
    assert store.pttl(PREFIX + key_text(key)) > 5_000
    assert read(tier, key) == payload(2)


def test_blocks_expire_after_their_ttl(server, tiers):
    tier = tiers(server.url, ttl_s=0.3)
    key = new_key()
    tier.put(key, filler(payload(3)))
    tier.flush()
    assert tier.contains([key]) == 1
    deadline = time.monotonic() + 3.0
    while tier.contains([key]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.contains([key]) == 0 and read(tier, key) is None


def test_altered_record_is_corrupt_a_miss_and_deleted(server, store, tiers):
    tier = tiers(server.url)
    key = new_key()
    tier.put(key, filler(payload(4)))
    tier.flush()
    name = PREFIX + key_text(key)
    value = bytearray(store.get(name))
    value[-1] ^= 0x01
    store.set(name, bytes(value))

    assert read(tier, key) is None
    s = tier.stats()
    assert (s.corrupt, s.misses, s.hits, s.errors) == (1, 1, 0, 0)
    assert not store.exists(name)


def test_record_under_another_keys_name_is_a_miss(server, store, tiers):
    tier = tiers(server.url)
    a, b = new_key(), new_key()
    tier.put(a, filler(payload(5)))
    tier.flush()
    store.set(PREFIX + key_text(b), store.get(PREFIX + key_text(a)))

    assert read(tier, b) is None
    assert read(tier, a) == payload(5)
    assert tier.stats().corrupt == 1 and not store.exists(PREFIX + key_text(b))


def test_killed_server_costs_one_error_then_nothing(own_servers, tiers):
    srv = own_servers()
    tier = tiers(srv.url, timeout_s=0.25, retry_after_s=1.0)
    key = new_key()
    tier.put(key, filler(payload(6)))
    tier.flush()
    assert read(tier, key) == payload(6)

    os.kill(srv.pid, signal.SIGKILL)
    srv.stop()  # reaps it
    assert not os.path.exists(f"/proc/{srv.pid}")
    fills: list[int] = []
    start = time.monotonic()
    for i in range(20):
        assert tier.contains([key]) == 0
        assert read(tier, key) is None
        assert tier.put(new_key(), filler(payload(i), fills)) is False
    assert time.monotonic() - start < 2.0
    s = tier.stats()
    assert s.errors == 1 and s.dropped_writes == 20 and s.misses == 20 and not fills  # down: no fill, no network

    time.sleep(1.1)  # the breaker closes: the next call tries the (dead) server again
    assert tier.contains([key]) == 0 and tier.stats().errors == 2


def test_stalled_server_costs_one_timeout_then_recovers(own_servers, tiers):
    srv = own_servers()
    tier = tiers(srv.url, timeout_s=0.25, retry_after_s=0.5)
    key = new_key()
    tier.put(key, filler(payload(7)))
    tier.flush()
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        hit, first_s = timed(lambda: read(tier, key))
        assert hit is None and first_s < 1.5
        start = time.monotonic()
        for i in range(10):
            assert read(tier, key) is None and tier.contains([key]) == 0
            assert tier.put(new_key(), filler(payload(i))) is False
        assert time.monotonic() - start < 0.1  # the breaker is open: nothing waits on the socket
        assert tier.stats().errors == 1
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    time.sleep(0.6)
    assert read(tier, key) == payload(7)
    assert tier.contains([key]) == 1


def test_writes_beyond_max_pending_are_dropped_and_a_stalled_writer_never_raises(own_servers, tiers):
    srv = own_servers()
    tier = tiers(srv.url, timeout_s=0.25, retry_after_s=5.0, max_pending=4)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        accepted = [tier.put(new_key(), filler(payload(i))) for i in range(10)]
        # 4 queued, plus the one batch the writer took before it blocked on the stopped server's socket: it pops
        # whatever the queue held when it woke (up to max_pending), and never pops again until the timeout
        assert 4 <= sum(accepted) <= 8
        _, flush_s = timed(lambda: tier.flush(3.0))
        assert flush_s < 1.5  # one timeout, then the breaker drops the rest
        tier.check_integrity()  # the writer thread is alive
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    s = tier.stats()
    assert s.dropped_writes == 10 and s.errors == 1 and s.bytes_written == 0


def test_concurrent_puts_and_gets_keep_the_counters_consistent(server, tiers):
    tier = tiers(server.url, max_pending=1024)
    keys = [[new_key() for _ in range(40)] for _ in range(4)]

    def worker(mine: list[bytes]) -> None:
        for i, key in enumerate(mine):
            tier.put(key, filler(payload(i)))
            read(tier, mine[i // 2])

    threads = [threading.Thread(target=worker, args=(mine,)) for mine in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tier.flush()
    tier.check_integrity()
    s = tier.stats()
    assert s.hits + s.misses == 160 and s.blocks == 160 and s.errors == 0
    assert all(read(tier, key) == payload(i) for mine in keys for i, key in enumerate(mine))


def test_allkeys_lru_server_stays_within_maxmemory_and_evicts_old_blocks(own_servers, tiers):
    srv = own_servers(maxmemory_mb=2, maxmemory_policy="allkeys-lru")
    client = redis.Redis.from_url(srv.url)
    payload_bytes = 16 * 1024
    tier = tiers(srv.url, payload_bytes=payload_bytes, capacity_bytes=2 << 20)
    keys = [new_key() for _ in range(320)]  # 5 MB of records into a 2 MB server
    try:
        for i, key in enumerate(keys):
            assert tier.put(key, filler(payload(i, payload_bytes)))
            if i % 32 == 31:
                tier.flush()
                memory = client.info("memory")
                assert memory["used_memory"] <= memory["maxmemory"] + 512 * 1024
        present = [bool(client.exists(PREFIX + key_text(key))) for key in keys]
    finally:
        client.close()
    assert sum(present[:80]) <= 20, "the oldest quarter should be mostly evicted (LRU is approximate)"
    assert sum(present[-8:]) >= 6, "the newest blocks should still be there"
    evicted = keys[present.index(False)]
    assert read(tier, evicted) is None
    assert read(tier, keys[-1]) == payload(319, payload_bytes)
    s = tier.stats()
    assert s.errors == 0 and s.dropped_writes == 0 and s.corrupt == 0
    assert s.used_bytes <= s.capacity_bytes  # the occupancy estimate is capped at the capacity given
