"""The KV tier contract (`kvbaton/kv/store/base.py`), checked on every tier the same way: a real shm arena in
/dev/shm, real files, the module's private redis-server and a private Mooncake Store (each started once for this
module, each test using keys of its own, stopped by PID).

Each behaviour is one test parametrized over `TIERS`, every tier made by the `make_tier` fixture. Where tiers
genuinely differ (whether a second put rewrites, what `stats()` counts, when an expired block goes) the difference
is a table below, keyed by tier, never a copy of a test: adding a tier is one entry in `TIERS`, one in `BACKENDS`
and one in each table. What only one tier has stays in its own file (test_shm_tier.py, test_disk_tier.py,
test_redis_tier.py, test_mooncake_tier.py).
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbaton.kv.store.base import KVTier
from kvbaton.kv.store.keys import KEY_BYTES, key_text
from kvbaton.kv.store.records import HEADER_BYTES, MAC_BYTES, RecordKey

PAYLOAD = 4096
RECORD = HEADER_BYTES + PAYLOAD
TIERS = ["shm", "disk", "redis", "mooncake"]
# Tiers that frame each block as a `records` record (header naming the key, MAC): shm keeps blocks in memory that
# only this host's workers map, with no framing and no MAC, so nothing there can be a corrupt record.
RECORD_TIERS = ["disk", "redis", "mooncake"]
RECORD_KEY = RecordKey.of_secret(b"tier-contract-test-secret-012345")  # a deployment's cluster secret

# ---- where the tiers differ --------------------------------------------------------------------------------------

# stats().shared: one store every worker uses, counted once across workers (disk: one process per directory).
SHARED = {"shm": True, "disk": False, "redis": True, "mooncake": True}

# What stats().blocks counts: the blocks it holds now ("live": an expired or dropped one is not counted), the
# records this tier landed ("landed": redis expires and evicts server-side, unseen), or nothing (None: the
# Mooncake master places and evicts objects; the tier keeps no count).
BLOCKS_COUNTED = {"shm": "live", "disk": "live", "redis": "landed", "mooncake": None}

# stats().used_bytes per counted block: the payload (shm), or the record, header included (disk, redis).
USED_BYTES_PER_BLOCK = {"shm": PAYLOAD, "disk": RECORD, "redis": RECORD, "mooncake": 0}

# Whether a put of a present key writes it again (fill called, the new payload kept: redis SETs it, mooncake
# replaces the object) or refreshes the one there (fill never called, the old payload kept: shm, disk).
REWRITES_PRESENT = {"shm": False, "disk": False, "redis": True, "mooncake": True}

# Whether contains() sees a block's expiry. Mooncake's expiry travels inside the object, read by get(): contains()
# (one existence check per key) sees an expired block until a get() removes it.
CONTAINS_SEES_EXPIRY = {"shm": True, "disk": True, "redis": True, "mooncake": False}

# Whether stats().expirations counts a block found expired by a read (shm counts one when it reclaims the slot;
# redis expires keys server-side, unseen).
EXPIRY_COUNTED = {"shm": False, "disk": True, "redis": False, "mooncake": True}

# Whether an expired block is gone from the tier's storage once a read found it expired (shm leaves the slot to be
# reclaimed when its set needs room).
EXPIRED_REMOVED = {"shm": False, "disk": True, "redis": True, "mooncake": True}


# ---- keys, payloads --------------------------------------------------------------------------------------------


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(PAYLOAD)


def filler(data: bytes | bytearray, calls: list[int] | None = None) -> Callable[[memoryview], None]:
    def fill(view: memoryview) -> None:
        if calls is not None:
            calls.append(1)
        view[:] = data

    return fill


def read(tier: KVTier, key: bytes) -> bytes | None:
    out: list[bytes] = []
    return out[0] if tier.get(key, lambda view: out.append(bytes(view))) else None


# ---- an attacker's records: the format is public (records.py), the cluster secret is not --------------------------

MAC_FIELD = slice(8, 8 + MAC_BYTES)  # magic (4) | version (1) | reserved (3) | MAC | key | length | payload
SIGNED = slice(8 + MAC_BYTES, None)  # key, length, payload
FORMAT_2 = struct.Struct(f"<4sB3x{KEY_BYTES}sQI4x")  # before: magic | version | key | length | CRC-32 | pad


def crc(key: bytes, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(key))


def with_mac(record: bytes, evil: bytes, mac: Callable[[bytearray], bytes]) -> bytes:
    forged = bytearray(record[:HEADER_BYTES] + evil)
    forged[MAC_FIELD] = mac(forged)
    return bytes(forged)


# how to turn a genuine record of `key` into one holding `evil`, without the secret
FORGERIES: dict[str, Callable[[bytes, bytes, bytes], bytes]] = {
    # what every record tier served before (format 2): the checksum is anyone's to compute
    "format 2, CRC-32 recomputed": lambda record, key, evil: FORMAT_2.pack(b"KVBK", 2, key, PAYLOAD,
                                                                           crc(key, evil)) + evil,
    "genuine MAC kept": lambda record, key, evil: with_mac(record, evil, lambda r: r[MAC_FIELD]),
    "CRC-32 in the MAC field": lambda record, key, evil: with_mac(
        record, evil, lambda r: crc(key, evil).to_bytes(MAC_BYTES, "little")),
    "HMAC under a guessed secret": lambda record, key, evil: with_mac(
        record, evil, lambda r: RecordKey.of_secret(b"guessed-secret-0123456789abcdef").mac(memoryview(r)[SIGNED])),
}


# ---- the tiers, and their storage as a test sees it ------------------------------------------------------------


class Backend(ABC):
    """Where a tier keeps its blocks: open a tier on it (again), and reach the stored records behind its back, as
    anyone who may write the storage can (files, a redis client, a Mooncake client), never through the tier."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.request, self.tmp_path = request, tmp_path

    @abstractmethod
    def open(self, ttl_s: float, capacity_blocks: int, record_key: RecordKey) -> KVTier:
        """A tier over this storage (what an earlier one stored is there), signing records under `record_key`."""

    @abstractmethod
    def holds(self, tier: KVTier, key: bytes) -> bool:
        """The storage still has a block under `key`'s name (expired or not)."""

    def stored(self, tier: KVTier, key: bytes) -> bytes:
        """The value stored under `key`'s name: its record, after whatever the tier keeps in front of it."""
        raise NotImplementedError(f"{type(self).__name__} stores no records")

    def plant(self, tier: KVTier, key: bytes, value: bytes) -> None:
        """Store `value` under `key`'s name, replacing what is there."""
        raise NotImplementedError(f"{type(self).__name__} stores no records")

    def flip_last_byte(self, tier: KVTier, key: bytes) -> None:
        """Flip the last byte (a payload byte) of `key`'s stored record."""
        value = bytearray(self.stored(tier, key))
        value[-1] ^= 0x01
        self.plant(tier, key, bytes(value))

    def copy_record(self, tier: KVTier, src: bytes, dst: bytes) -> None:
        """Store `src`'s record under `dst`'s name."""
        self.plant(tier, dst, self.stored(tier, src))

    def check(self, tier: KVTier) -> None:
        """The tier's invariants (bookkeeping against its storage)."""
        tier.flush()
        tier.check_integrity()

    def cleanup(self) -> None:
        """Remove what the storage left for this test alone (an arena, a client); a shared server stays."""
        return None


class ShmBackend(Backend):
    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        super().__init__(request, tmp_path)
        self.name = f"contract-{os.getpid()}-{secrets.token_hex(4)}"

    def open(self, ttl_s: float, capacity_blocks: int, record_key: RecordKey) -> KVTier:
        from kvbaton.kv.store.shm_tier import ShmTier

        return ShmTier(self.name, PAYLOAD, capacity_blocks * PAYLOAD, ttl_s)

    def holds(self, tier, key: bytes) -> bool:
        from kvbaton.kv.store.shm_tier import READY

        row = tier._headers[tier._set_of(key)]
        return any(h["state"] == READY and h["key"].tobytes() == key for h in row)

    def cleanup(self) -> None:
        from kvbaton.kv.store.shm_tier import ShmTier

        ShmTier.destroy(self.name, PAYLOAD)


class DiskBackend(Backend):
    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        super().__init__(request, tmp_path)
        self.directory = tmp_path / "l3"

    def open(self, ttl_s: float, capacity_blocks: int, record_key: RecordKey) -> KVTier:
        from kvbaton.kv.store.disk_tier import DiskTier

        return DiskTier(self.directory, PAYLOAD, capacity_blocks * RECORD, ttl_s, record_key=record_key)

    def path(self, key: bytes) -> Path:
        return self.directory / key_text(key)[:2] / f"{key_text(key)}.kvb"

    def holds(self, tier, key: bytes) -> bool:
        return self.path(key).exists()

    def stored(self, tier, key: bytes) -> bytes:
        return self.path(key).read_bytes()

    def plant(self, tier, key: bytes, value: bytes) -> None:
        self.path(key).parent.mkdir(exist_ok=True)
        self.path(key).write_bytes(value)

    def check(self, tier) -> None:
        super().check(tier)
        s = tier.stats()
        on_disk = sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
        assert s.used_bytes == on_disk == s.blocks * RECORD
        assert s.used_bytes <= s.capacity_bytes


class RedisBackend(Backend):
    PREFIX = "kvb:kv:"  # the tier's default

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        import redis

        super().__init__(request, tmp_path)
        self.url = request.getfixturevalue("server").url  # the module's private redis-server (tests/kv/conftest.py)
        self.client = redis.Redis.from_url(self.url)

    def open(self, ttl_s: float, capacity_blocks: int, record_key: RecordKey) -> KVTier:
        from kvbaton.kv.store.redis_tier import RedisTier

        return RedisTier(self.url, PAYLOAD, ttl_s, record_key=record_key, max_pending=1024)

    def holds(self, tier, key: bytes) -> bool:
        return bool(self.client.exists(self.PREFIX + key_text(key)))

    def stored(self, tier, key: bytes) -> bytes:
        return self.client.get(self.PREFIX + key_text(key))

    def plant(self, tier, key: bytes, value: bytes) -> None:
        self.client.set(self.PREFIX + key_text(key), value)

    def cleanup(self) -> None:
        self.client.close()


class MooncakeBackend(Backend):
    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        super().__init__(request, tmp_path)
        self.store = request.getfixturevalue("mooncake_store")

    def open(self, ttl_s: float, capacity_blocks: int, record_key: RecordKey) -> KVTier:
        from kvbaton.kv.store.mooncake_tier import MooncakeTier

        return MooncakeTier(self.store.master, self.store.metadata_url, PAYLOAD, ttl_s, record_key=record_key)

    @staticmethod
    def name(key: bytes) -> str:
        from kvbaton.kv.store.mooncake_tier import PREFIX

        return PREFIX + key_text(key)

    def holds(self, tier, key: bytes) -> bool:
        return tier._client.is_exist(self.name(key)) == 1

    def stored(self, tier, key: bytes) -> bytes:
        return bytes(tier._client.get(self.name(key)))

    def plant(self, tier, key: bytes, value: bytes) -> None:
        tier._client.remove(self.name(key), True)  # a put does not replace an object
        assert tier._client.put(self.name(key), value) == 0


BACKENDS: dict[str, type[Backend]] = {"shm": ShmBackend, "disk": DiskBackend, "redis": RedisBackend,
                                      "mooncake": MooncakeBackend}


class TierUnderTest:
    """One tier as a test drives it: `tier` (the open one), `key(i)` (keys of this test alone), `reopen()` (close
    it, open another over the same storage, under the same record key or another), and the storage behind its back
    (`holds`, `stored`, `plant`, `flip_last_byte`, `copy_record`)."""

    def __init__(self, backend: Backend, ttl_s: float, capacity_blocks: int, namespace: str) -> None:
        self.backend, self.ttl_s, self.capacity_blocks, self.namespace = backend, ttl_s, capacity_blocks, namespace
        self.tier = backend.open(ttl_s, capacity_blocks, RECORD_KEY)

    def key(self, i: int) -> bytes:
        return hashlib.blake2b(f"{self.namespace}:{i}".encode(), digest_size=KEY_BYTES).digest()

    def reopen(self, record_key: RecordKey = RECORD_KEY) -> KVTier:
        self.tier.close()
        self.tier = self.backend.open(self.ttl_s, self.capacity_blocks, record_key)
        return self.tier

    def holds(self, key: bytes) -> bool:
        return self.backend.holds(self.tier, key)

    def stored(self, key: bytes) -> bytes:
        return self.backend.stored(self.tier, key)

    def plant(self, key: bytes, value: bytes) -> None:
        self.backend.plant(self.tier, key, value)

    def flip_last_byte(self, key: bytes) -> None:
        self.backend.flip_last_byte(self.tier, key)

    def copy_record(self, src: bytes, dst: bytes) -> None:
        self.backend.copy_record(self.tier, src, dst)

    def check(self) -> None:
        self.backend.check(self.tier)

    def close(self) -> None:
        self.check()
        start = time.monotonic()
        self.tier.close()
        assert time.monotonic() - start < 6.0, "close() took too long"


@pytest.fixture(scope="module")
def mooncake_store():
    """A private Mooncake Store (mooncake_master + the process holding its memory), shared by this module's tests:
    each uses keys of its own. A test that kills a store starts its own (test_mooncake_tier.py)."""
    from kvbaton.kv.store.mooncake_store import start_mooncake_store

    s = start_mooncake_store(64 * 2**20)
    yield s
    s.stop()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in s.pids), "a Mooncake process outlived stop()"


@pytest.fixture
def make_tier(request, tmp_path):
    """make_tier(name, ttl_s=60, capacity_blocks=64) -> TierUnderTest; checked and closed after the test."""
    made: list[tuple[Backend, TierUnderTest]] = []

    def make(name: str, ttl_s: float = 60.0, capacity_blocks: int = 64) -> TierUnderTest:
        backend = BACKENDS[name](request, tmp_path)
        made.append((backend, TierUnderTest(backend, ttl_s, capacity_blocks, f"{request.node.nodeid}:"
                                                                             f"{secrets.token_hex(4)}")))
        return made[-1][1]

    yield make
    for backend, tut in made:
        try:
            tut.close()
        finally:
            backend.cleanup()


# ---- the contract ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TIERS)
def test_a_block_reads_back_exactly_and_a_miss_is_a_miss(make_tier, name):
    t = make_tier(name)
    tier, k = t.tier, t.key
    for i in range(3):
        assert tier.put(k(i), filler(payload(i)))
    tier.flush()
    assert [read(tier, k(i)) for i in range(3)] == [payload(i) for i in range(3)]
    assert tier.contains([k(0), k(1), k(2)]) == 3
    assert tier.contains([k(0), k(9), k(1)]) == 1  # leading keys only
    assert tier.contains([k(9), k(0)]) == 0
    assert tier.contains([k(1), k(2), k(9), k(1)]) == 2
    assert tier.contains([]) == 0
    sunk: list[memoryview] = []
    assert tier.get(k(9), sunk.append) is False and not sunk  # a miss: False, and no sink called
    s = tier.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt, s.dropped_writes) == (3, 1, 0, 0, 0)
    assert s.bytes_read == s.bytes_written == 3 * PAYLOAD and s.read_bandwidth > 0
    assert s.shared is SHARED[name]
    counted = 3 if BLOCKS_COUNTED[name] else 0
    assert (s.blocks, s.used_bytes) == (counted, counted * USED_BYTES_PER_BLOCK[name])
    t.check()


@pytest.mark.parametrize("name", TIERS)
def test_put_copies_the_payload_before_returning(make_tier, name):
    t = make_tier(name)
    rows = bytearray(payload(1))
    assert t.tier.put(t.key(1), filler(rows))
    rows[:] = bytes(PAYLOAD)  # the pool block is reused right after put
    t.tier.flush()
    assert read(t.tier, t.key(1)) == payload(1)
    t.check()


@pytest.mark.parametrize("name", TIERS)
def test_a_put_of_a_present_block_refreshes_its_ttl(make_tier, name):
    ttl_s = 1.0
    t = make_tier(name, ttl_s=ttl_s)
    key = t.key(0)
    assert t.tier.put(key, filler(payload(0)))
    t.tier.flush()
    first, fills, puts = time.monotonic(), [], 0
    while time.monotonic() - first < 1.2 * ttl_s:  # on, well past the first put's TTL...
        # puts 0.2 s apart, each well within the TTL the one before set
        time.sleep(0.2)  # noqa: TID251 - how a put extends a present block's TTL is the behaviour under test
        puts += 1
        assert t.tier.put(key, filler(payload(puts), fills))  # expires ttl_s from now, not from the first write
        t.tier.flush()
    rewrites = REWRITES_PRESENT[name]
    assert read(t.tier, key) == payload(puts if rewrites else 0)  # ...and the block lives on
    assert len(fills) == (puts if rewrites else 0)  # a refresh fills nothing
    assert t.tier.stats().bytes_written == (1 + puts if rewrites else 1) * PAYLOAD
    t.check()


@pytest.mark.parametrize("name", TIERS)
def test_a_fill_that_fails_leaves_nothing_readable(make_tier, name):
    t = make_tier(name)
    key = t.key(9)

    def broken(dst: memoryview) -> None:
        dst[:10] = b"x" * 10
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        t.tier.put(key, broken)
    t.tier.flush()
    assert t.tier.contains([key]) == 0 and read(t.tier, key) is None
    assert t.tier.put(key, filler(payload(9)))  # and the block goes in whole later
    t.tier.flush()
    assert read(t.tier, key) == payload(9)
    t.check()


@pytest.mark.parametrize("name", TIERS)
def test_an_expired_block_is_a_miss(make_tier, name):
    t = make_tier(name, ttl_s=0.4)
    key = t.key(5)
    assert t.tier.put(key, filler(payload(5)))
    t.tier.flush()
    assert t.tier.contains([key]) == 1
    time.sleep(0.5)  # noqa: TID251 - the 0.4 s TTL running out is the behaviour under test
    if CONTAINS_SEES_EXPIRY[name]:
        assert t.tier.contains([key]) == 0
    assert read(t.tier, key) is None and t.tier.contains([key]) == 0
    assert t.tier.stats().expirations == (1 if EXPIRY_COUNTED[name] else 0)
    assert t.holds(key) is not EXPIRED_REMOVED[name]
    if BLOCKS_COUNTED[name] == "live":
        assert t.tier.put(t.key(6), filler(payload(6)))
        t.tier.flush()
        assert t.tier.stats().blocks == 1  # the expired block is not counted
    t.check()


@pytest.mark.parametrize("name", TIERS)
def test_blocks_outlive_the_tier_that_wrote_them(make_tier, name):
    t = make_tier(name)
    writer = t.tier
    assert all(writer.put(t.key(i), filler(payload(i))) for i in range(8))
    writer.flush()
    assert writer.contains([t.key(i) for i in [0, 1, 2, 99, 3]]) == 3
    reader = t.reopen()  # the writer closed (a worker gone): its blocks stay
    assert [read(reader, t.key(i)) for i in range(8)] == [payload(i) for i in range(8)]
    assert read(reader, t.key(99)) is None
    s = reader.stats()
    assert (s.hits, s.misses, s.errors, s.corrupt) == (8, 1, 0, 0) and s.shared is SHARED[name]
    t.check()


@pytest.mark.parametrize("name", RECORD_TIERS)
def test_a_corrupt_record_is_a_miss_counted_and_dropped(make_tier, name):
    t = make_tier(name)
    for i in (0, 1):
        assert t.tier.put(t.key(i), filler(payload(i)))
    t.tier.flush()
    t.flip_last_byte(t.key(0))
    assert read(t.tier, t.key(0)) is None
    s = t.tier.stats()
    assert (s.corrupt, s.misses, s.hits, s.errors) == (1, 1, 0, 0)
    assert not t.holds(t.key(0)) and t.tier.contains([t.key(0)]) == 0
    if BLOCKS_COUNTED[name] == "live":
        assert s.blocks == 1
    assert read(t.tier, t.key(1)) == payload(1)
    assert t.tier.put(t.key(0), filler(payload(0)))  # written again, whole
    t.tier.flush()
    assert read(t.tier, t.key(0)) == payload(0)
    t.check()


@pytest.mark.parametrize("name", RECORD_TIERS)
def test_a_record_under_another_keys_name_is_a_miss(make_tier, name):
    t = make_tier(name)
    a, b = t.key(0), t.key(1)
    assert t.tier.put(a, filler(payload(0)))
    t.tier.flush()
    t.copy_record(a, b)
    tier = t.reopen()  # (the disk tier indexes its files when it opens)
    assert tier.contains([b]) == 1  # the name and size look right: only the header tells
    assert read(tier, b) is None
    assert read(tier, a) == payload(0)
    assert tier.stats().corrupt == 1 and not t.holds(b)
    t.check()


@pytest.mark.parametrize("name", RECORD_TIERS)
def test_a_forged_record_is_a_miss_counted_and_dropped(make_tier, name):
    """Whoever may write the storage (a redis client with the password, a host reaching the Mooncake store, the disk
    directory's owner) plants KV under a store key they computed, straight into the storage: every forgery is a
    miss, counted corrupt and dropped; the genuine block, written again, is a hit."""
    t = make_tier(name)
    key, evil = t.key(0), payload(666)
    for n, (how, forge) in enumerate(FORGERIES.items(), start=1):
        assert t.tier.put(key, filler(payload(0)))
        t.tier.flush()
        value = t.stored(key)
        front, record = value[:-RECORD], value[-RECORD:]  # front: what the tier keeps before it (mooncake's expiry)
        t.plant(key, front + forge(record, key, evil))
        assert read(t.tier, key) is None, how
        assert t.tier.stats().corrupt == n and not t.holds(key), how
    assert t.tier.put(key, filler(payload(0)))
    t.tier.flush()
    assert read(t.tier, key) == payload(0)
    s = t.tier.stats()
    assert (s.hits, s.misses, s.corrupt, s.errors) == (1, len(FORGERIES), len(FORGERIES), 0)
    t.check()


@pytest.mark.parametrize("name", RECORD_TIERS)
def test_blocks_signed_under_another_cluster_secret_are_misses(make_tier, name):
    """A process on the same store without the deployment's KVBATON_CLUSTER_SECRET (another cluster, a replica
    started without it): the blocks look present, none verifies; each read is a miss, counted corrupt."""
    t = make_tier(name)
    assert all(t.tier.put(t.key(i), filler(payload(i))) for i in range(2))
    t.tier.flush()
    other = t.reopen(RecordKey.of_secret(b"another-cluster-secret-012345678"))
    assert other.contains([t.key(0), t.key(1)]) == 2  # the names and sizes look right: only the MAC tells
    assert read(other, t.key(0)) is None
    s = other.stats()
    assert (s.corrupt, s.misses, s.hits) == (1, 1, 0)
    assert t.holds(t.key(1))  # (a genuine record under the right secret is a hit: the test above)
    t.check()


@pytest.mark.parametrize("name", TIERS)
def test_calls_from_several_threads_keep_the_counters(make_tier, name):
    """The engine thread saves while the loader thread reads (and several savers at once): no call fails for
    another's sake, and the counters add up."""
    t = make_tier(name, capacity_blocks=1024)  # room for every block
    tier, k = t.tier, t.key
    stored = range(16)
    assert all(tier.put(k(i), filler(payload(i))) for i in stored)
    tier.flush()
    mine = [list(range(100 + 40 * w, 140 + 40 * w)) for w in range(4)]
    failures: list[str] = []

    def reader() -> None:
        for _ in range(5):
            failures.extend(f"get {i}" for i in stored if read(tier, k(i)) != payload(i))

    def writer(ids: list[int]) -> None:
        for n, i in enumerate(ids):
            if not tier.put(k(i), filler(payload(i))):
                failures.append(f"put {i}")
            earlier = ids[n // 2]
            if read(tier, k(earlier)) not in (None, payload(earlier)):  # None: still on its way (a queued write)
                failures.append(f"read {earlier}")

    threads = [threading.Thread(target=reader), *(threading.Thread(target=writer, args=(ids,)) for ids in mine)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    tier.flush()
    assert not failures
    s = tier.stats()
    assert s.hits + s.misses == 5 * len(stored) + sum(map(len, mine))
    assert (s.errors, s.corrupt, s.dropped_writes) == (0, 0, 0)
    everything = [*stored, *(i for ids in mine for i in ids)]
    assert all(read(tier, k(i)) == payload(i) for i in everything)
    if BLOCKS_COUNTED[name]:
        assert s.blocks == len(everything)
    t.check()


def test_every_tier_is_in_the_contract():
    """A tier added to kvbaton is added here too: in TIERS, BACKENDS and every table of how tiers differ."""
    from kvbaton.config import STORE_TIERS

    assert sorted(TIERS) == sorted(STORE_TIERS) == sorted(BACKENDS)
    tables = [SHARED, BLOCKS_COUNTED, USED_BYTES_PER_BLOCK, REWRITES_PRESENT, CONTAINS_SEES_EXPIRY, EXPIRY_COUNTED,
              EXPIRED_REMOVED]
    assert all(sorted(table) == sorted(TIERS) for table in tables)
