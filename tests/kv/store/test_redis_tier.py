"""What only the L4 Redis tier has, against real, private redis-servers (started here, stopped by PID): a TTL on
every key, a killed and a stalled server behind the circuit breaker, a bounded write queue, and allkeys-lru
capacity. The contract every tier keeps (roundtrip, misses, refresh, expiry, corrupt and misplaced records,
threads, ...) is test_tier_contract.py."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import redis

from kvbaton.kv.redis_server import RedisServer, redis_server_binary, start_redis_server
from kvbaton.kv.store.keys import KEY_BYTES, key_text
from kvbaton.kv.store.records import RecordKey
from kvbaton.kv.store.redis_tier import RedisTier

# NOTE: no skip: scripts/setup.sh installs redis-server, so its absence is a set-up failure to see.
assert redis_server_binary() is not None, "redis-server is not installed (scripts/setup.sh installs it with apt-get)"

PAYLOAD = 4096
PREFIX = "kvb:kv:"
RECORD_KEY = RecordKey.of_secret(b"redis-tier-test-secret-012345678")


@pytest.fixture
def tiers():
    """make(url, **options) -> RedisTier; each is integrity-checked and closed after the test."""
    made: list[RedisTier] = []

    def make(url: str, payload_bytes: int = PAYLOAD, ttl_s: float = 30.0, **options) -> RedisTier:
        made.append(RedisTier(url, payload_bytes, ttl_s, record_key=RECORD_KEY, **options))
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


def test_every_block_carries_the_ttl(server, store, tiers):
    """Every SET carries PX ttl_ms: no block outlives ttl_s after its last write, on the server's own clock."""
    tier = tiers(server.url, ttl_s=30.0)
    keys = [new_key() for _ in range(3)]
    for i, key in enumerate(keys):
        assert tier.put(key, filler(payload(i)))
    tier.flush()
    for key in keys:
        assert 0 < store.pttl(PREFIX + key_text(key)) <= 30_000


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

    time.sleep(1.1)  # noqa: TID251 - retry_after_s (1.0 s) running out is the behaviour under test: the breaker closes,
    # and the next call tries the (dead) server again
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
        for i in range(10):
            assert read(tier, key) is None and tier.contains([key]) == 0
            assert tier.put(new_key(), filler(payload(i))) is False
        # the breaker is open: nothing waits on the socket (a call that did would time out on the stopped server
        # and count an error), every read is a miss and every write dropped with no network
        s = tier.stats()
        assert (s.errors, s.misses, s.dropped_writes) == (1, 11, 10)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    time.sleep(0.6)  # noqa: TID251 - retry_after_s (0.5 s) running out is the behaviour under test: the breaker closes
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
