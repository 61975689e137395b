"""What only the L3 disk tier has, on real files: private files, exact LRU, capacity, the writer thread and its
pruning, restarts, write failures and a full disk. The contract every tier keeps (roundtrip, misses, refresh,
expiry, corrupt and misplaced records, ...) is test_tier_contract.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvbaton.kv.store import disk_tier
from kvbaton.kv.store.disk_tier import QUEUE_RECORDS, DiskTier
from kvbaton.kv.store.keys import KEY_BYTES, key_text
from kvbaton.kv.store.records import HEADER_BYTES, RecordKey

PAYLOAD = 4096
RECORD = HEADER_BYTES + PAYLOAD
RECORD_KEY = RecordKey.of_secret(b"disk-tier-test-secret-0123456789")
MakeTier = Callable[..., DiskTier]


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=KEY_BYTES).digest()


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(PAYLOAD)


def filler(data: bytes | bytearray) -> Callable[[memoryview], None]:
    def fill(view: memoryview) -> None:
        view[:] = data

    return fill


def read(tier: DiskTier, k: bytes) -> bytes | None:
    out: list[bytes] = []
    return out[0] if tier.get(k, lambda view: out.append(bytes(view))) else None


def path_of(directory: Path, k: bytes) -> Path:
    return directory / key_text(k)[:2] / f"{key_text(k)}.kvb"


def put_all(tier: DiskTier, ids: range | list[int]) -> None:
    for i in ids:
        assert tier.put(key(i), filler(payload(i)))
    tier.flush()


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def check(tier: DiskTier) -> None:
    """The invariants after every scenario: bookkeeping matches the index, the index the files."""
    tier.flush()
    tier.check_integrity()
    s = tier.stats()
    assert s.used_bytes == disk_bytes(tier.directory) == s.blocks * RECORD
    assert s.used_bytes <= s.capacity_bytes


@pytest.fixture
def make(tmp_path: Path) -> Iterator[MakeTier]:
    tiers: list[DiskTier] = []

    def make_tier(blocks: float = 16, ttl_s: float = 60.0, directory: Path | None = None) -> DiskTier:
        tier = DiskTier(directory or tmp_path / "l3", PAYLOAD, int(blocks * RECORD), ttl_s, record_key=RECORD_KEY)
        tiers.append(tier)
        return tier

    yield make_tier
    for tier in tiers:
        tier.close()


def test_block_files_and_their_shards_are_private(make: MakeTier) -> None:
    tier = make()
    put_all(tier, [0])
    assert stat.S_IMODE(path_of(tier.directory, key(0)).stat().st_mode) == 0o600
    assert stat.S_IMODE(path_of(tier.directory, key(0)).parent.stat().st_mode) == 0o700
    check(tier)


def test_one_tier_per_directory_and_only_a_private_one(make: MakeTier, tmp_path: Path) -> None:
    """A second tier on an open directory is refused (each would count only its own files and evict the
    other's); after the first closes it opens. A directory others may write is refused: they could plant
    records served to every matching prompt."""
    tier = make()
    with pytest.raises(RuntimeError, match="in use by another DiskTier"):
        DiskTier(tier.directory, PAYLOAD, 16 * RECORD, 60.0, record_key=RECORD_KEY)
    tier.close()
    make(directory=tier.directory).close()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="no one else may write"):
        DiskTier(shared, PAYLOAD, 16 * RECORD, 60.0, record_key=RECORD_KEY)


def test_a_planted_temp_name_is_never_written_through(make: MakeTier, tmp_path: Path) -> None:
    """Temp files get random names, created with O_EXCL | O_NOFOLLOW: a symlink planted where the old fixed temp
    name (`.<record>.tmp`) was would have led a write into the file it points at."""
    tier = make()
    target = tmp_path / "victim"
    target.write_bytes(b"untouched")
    record = path_of(tier.directory, key(0))
    record.parent.mkdir(mode=0o700, exist_ok=True)
    (record.parent / f".{record.name}.tmp").symlink_to(target)
    put_all(tier, [0])
    tier.flush()
    assert target.read_bytes() == b"untouched" and read(tier, key(0)) == payload(0)


def test_exact_lru_eviction_order(make: MakeTier) -> None:
    tier = make(blocks=3)
    put_all(tier, range(3))  # LRU order: 0 1 2
    assert read(tier, key(0)) == payload(0)  # 1 2 0
    put_all(tier, [3])  # evicts 1 -> 2 0 3
    assert [tier.contains([key(i)]) for i in range(4)] == [1, 0, 1, 1]
    assert tier.put(key(2), filler(payload(2)))  # a refresh: 0 3 2
    put_all(tier, [4])  # evicts 0 -> 3 2 4
    assert [tier.contains([key(i)]) for i in range(5)] == [0, 0, 1, 1, 1]
    assert not path_of(tier.directory, key(0)).exists() and not path_of(tier.directory, key(1)).exists()
    assert tier.stats().evictions == 2
    check(tier)


def test_capacity_is_never_exceeded(make: MakeTier) -> None:
    tier = make(blocks=2.5)
    for i in range(10):
        assert tier.put(key(i), filler(payload(i)))
        tier.flush()
        assert tier.stats().used_bytes <= tier.stats().capacity_bytes
        assert disk_bytes(tier.directory) <= tier.stats().capacity_bytes
    assert tier.stats().blocks == 2 and tier.stats().evictions == 8
    assert tier.contains([key(8), key(9)]) == 2
    check(tier)


def test_block_larger_than_capacity_is_never_written(make: MakeTier) -> None:
    tier = make(blocks=0.9)
    assert not tier.put(key(0), filler(payload(0)))
    tier.flush()
    assert tier.stats().blocks == 0 and disk_bytes(tier.directory) == 0
    check(tier)


def test_writer_prunes_expired_blocks(make: MakeTier) -> None:
    tier = make(blocks=2, ttl_s=0.2)
    put_all(tier, [0, 1])
    time.sleep(0.3)  # noqa: TID251 - the 0.2 s TTL running out is the behaviour under test
    put_all(tier, [2])
    s = tier.stats()
    assert (s.blocks, s.expirations, s.evictions) == (1, 2, 0)
    check(tier)


def test_survives_restart(make: MakeTier, tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    tier = make(directory=directory)
    put_all(tier, range(5))
    tier.close()
    now = time.time()
    for i in range(5):  # the write order the restart rebuilds LRU from: 3 is the oldest
        os.utime(path_of(directory, key(i)), (now, now - 10 + (i + 2) % 5))
    stale_temp = path_of(directory, key(9)).parent / ".leftover.kvb.tmp"
    stale_temp.parent.mkdir(exist_ok=True)
    stale_temp.write_bytes(b"half a record")
    with path_of(directory, key(1)).open("r+b") as f:
        f.truncate(RECORD // 2)  # a torn file from elsewhere: dropped at start
    other = directory / "README"
    other.write_text("not a block")
    reopened = make(blocks=3, directory=directory)
    assert [reopened.contains([key(i)]) for i in range(5)] == [1, 0, 1, 0, 1]  # 1 torn, 3 oldest over capacity
    assert [read(reopened, key(i)) for i in (0, 2, 4)] == [payload(i) for i in (0, 2, 4)]
    assert not stale_temp.exists() and not path_of(directory, key(1)).exists()
    assert other.exists()
    other.unlink()
    check(reopened)


def test_restart_applies_ttl_by_mtime(make: MakeTier, tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    tier = make(directory=directory, ttl_s=60)
    put_all(tier, [0, 1])
    tier.close()
    os.utime(path_of(directory, key(0)), (time.time(), time.time() - 120))
    reopened = make(directory=directory, ttl_s=60)
    assert reopened.contains([key(0)]) == 0 and reopened.contains([key(1)]) == 1
    assert not path_of(directory, key(0)).exists()
    check(reopened)


def test_close_drains_the_writer(make: MakeTier, tmp_path: Path) -> None:
    tier = make(directory=tmp_path / "l3")
    for i in range(8):
        assert tier.put(key(i), filler(payload(i)))
    tier.close()
    assert not tier.put(key(9), filler(payload(9)))
    reopened = make(directory=tmp_path / "l3")
    assert reopened.contains([key(i) for i in range(8)]) == 8
    check(reopened)


def test_write_failure_is_counted_and_the_tier_recovers(make: MakeTier) -> None:
    tier = make()
    shard = path_of(tier.directory, key(0)).parent
    shard.write_bytes(b"")  # a file where the shard directory goes: the write fails for real, even as root
    assert tier.put(key(0), filler(payload(0)))
    tier.flush()
    assert tier.stats().errors == 1
    assert read(tier, key(0)) is None and tier.contains([key(0)]) == 0
    check(tier)
    shard.unlink()
    put_all(tier, [0])
    assert read(tier, key(0)) == payload(0)
    check(tier)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_unwritable_shard_is_counted_and_the_tier_recovers(make: MakeTier) -> None:
    tier = make()
    shard = path_of(tier.directory, key(0)).parent
    shard.mkdir(mode=0o500)
    try:
        assert tier.put(key(0), filler(payload(0)))
        tier.flush()
        assert tier.stats().errors == 1 and read(tier, key(0)) is None
    finally:
        shard.chmod(0o700)
    assert list(shard.iterdir()) == []  # no temp file left behind
    put_all(tier, [0])
    assert read(tier, key(0)) == payload(0)
    check(tier)


_FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys, time
    from kvbaton.kv.store import disk_tier
    from kvbaton.kv.store.keys import KEY_BYTES
    from kvbaton.kv.store.records import RecordKey
    disk_tier._FULL_BACKOFF_S = 0.3
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    tier = disk_tier.DiskTier(sys.argv[1], 4096, 1 << 20, 60.0, record_key=RecordKey.of_secret(bytes(16)))
    fill = lambda view: view.__setitem__(slice(None), bytes([7]) * len(view))
    key = lambda i: bytes([i]) * KEY_BYTES
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    first = tier.put(key(1), fill)
    tier.flush()
    during = tier.put(key(2), fill)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    time.sleep(0.4)  # noqa: TID251 - past _FULL_BACKOFF_S: the back-off running out is the behaviour under test
    after = tier.put(key(3), fill)
    tier.flush()
    s = tier.stats()
    print(json.dumps([first, during, after, s.errors, s.dropped_writes, tier.contains([key(3)]),
                      tier.contains([key(1)])]))
    tier.check_integrity()
    tier.close()
""")


def test_full_disk_backs_off_then_recovers(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "l3")], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    first, during, after, errors, dropped, hit, lost = json.loads(run.stdout)
    assert (first, during, after) == (True, False, True)  # queued, skipped in the backoff, written
    assert (errors, dropped, hit, lost) == (1, 1, 1, 0)
    assert not [p for p in (tmp_path / "l3").rglob("*.tmp")]


def test_writer_behind_drops_writes(make: MakeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()
    real_write = disk_tier._write_record

    def slow_write(path: Path, record: bytearray) -> None:
        entered.set()
        assert release.wait(10)
        real_write(path, record)

    monkeypatch.setattr(disk_tier, "_write_record", slow_write)
    tier = make(blocks=QUEUE_RECORDS + 2)
    assert tier.put(key(0), filler(payload(0)))
    assert entered.wait(5)  # the writer holds block 0: the queue is empty again
    for i in range(1, QUEUE_RECORDS + 1):
        assert tier.put(key(i), filler(payload(i)))
    assert not tier.put(key(QUEUE_RECORDS + 1), filler(payload(0)))
    release.set()
    tier.flush()
    s = tier.stats()
    assert (s.dropped_writes, s.blocks) == (1, QUEUE_RECORDS + 1)
    check(tier)


def test_concurrent_readers_and_writer_keep_the_bookkeeping(make: MakeTier) -> None:
    tier = make(blocks=6)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            i = rng.randrange(12)
            if rng.random() < 0.5:
                tier.put(key(i), filler(payload(i)))
            else:
                got = read(tier, key(i))
                assert got is None or got == payload(i)
                tier.contains([key(i), key(i + 1)])

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = tier.stats()
    assert s.errors == 0 and s.corrupt == 0
    check(tier)
