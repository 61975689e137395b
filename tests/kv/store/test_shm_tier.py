"""What only the node-local shm tier has: a real arena in /dev/shm, shared with real processes (set-associative
LRU, slots of writers and readers that died, blocks being written right now, the arena file itself). The contract
every tier keeps (roundtrip, misses, refresh, a failed fill, expiry, ...) is test_tier_contract.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvbaton.kv.store.keys import KEY_BYTES
from kvbaton.kv.store.shm_tier import IN_FLIGHT_AGE_S, READY, WAYS, WRITING, ShmTier
from tests.support.procs import repo_python_env
from tests.support.wait import wait_until

PAYLOAD = 4096


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=KEY_BYTES).digest()


def payload(i: int) -> bytes:
    return (i % 251).to_bytes(1, "little") * PAYLOAD


def put(tier: ShmTier, i: int) -> bool:
    return tier.put(key(i), lambda dst: dst.__setitem__(slice(None), payload(i)))


def get(tier: ShmTier, i: int) -> bytes | None:
    out: list[bytes] = []
    return out[0] if tier.get(key(i), lambda src: out.append(bytes(src))) else None


def keys_of_set(tier: ShmTier, set_index: int, count: int) -> list[int]:
    """`count` key numbers that all map to `set_index`."""
    found = [i for i in range(100_000) if tier._set_of(key(i)) == set_index]
    return found[:count]


def stop(proc: subprocess.Popen) -> None:
    """Kill a helper process the test started, if it still runs (every exit path of a test)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def arena_name(request) -> str:
    name = f"test-{os.getpid()}-{request.node.name[:40]}".replace("[", "_").replace("]", "_")
    yield name
    ShmTier.destroy(name, PAYLOAD)


def test_a_key_ending_in_nul_is_found(arena_name):
    """numpy's "S" dtype would strip the NUL: the header stores raw bytes."""
    tier = ShmTier(arena_name, PAYLOAD, 64 * PAYLOAD, ttl_s=60)
    k = bytes(KEY_BYTES - 1) + b"\x01"
    k0 = b"\x07" * (KEY_BYTES - 1) + b"\x00"
    for kk in (k, k0):
        tier.put(kk, lambda dst: dst.__setitem__(slice(None), b"z" * PAYLOAD))
    assert tier.contains([k0, k]) == 2
    tier.close()


def test_lru_within_a_set_and_capacity(arena_name):
    tier = ShmTier(arena_name, PAYLOAD, 2 * WAYS * PAYLOAD, ttl_s=60)
    assert tier.num_sets == 2
    ids = keys_of_set(tier, 0, WAYS + 2)
    for i in ids[:WAYS]:
        assert put(tier, i)
        stamp = time.time()  # distinct access times: the next put's clock is past this one's
        wait_until(lambda stamp=stamp: time.time() > stamp, 5.0, interval_s=0.001)
    assert get(tier, ids[0]) == payload(ids[0])  # now the most recently used: ids[1] is the victim
    assert put(tier, ids[WAYS])
    assert get(tier, ids[1]) is None and get(tier, ids[0]) is not None
    assert put(tier, ids[WAYS + 1])
    assert get(tier, ids[2]) is None
    s = tier.stats()
    assert s.evictions == 2 and s.blocks == WAYS and s.used_bytes <= s.capacity_bytes
    tier.check_integrity()
    tier.close()


def dead_pid() -> int:
    """The PID of a process that has exited (and was reaped): it names no process now."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_writer_that_died_mid_copy_frees_its_slot_later(arena_name):
    tier = ShmTier(arena_name, PAYLOAD, WAYS * PAYLOAD, ttl_s=60)
    ids = keys_of_set(tier, 0, WAYS + 1)
    for i in ids[:WAYS]:
        put(tier, i)
    headers = tier._headers[0]
    headers["state"][:] = WRITING  # as if every writer of the set had died mid-copy, just now
    headers["writer"][:] = dead_pid()
    assert put(tier, ids[WAYS])  # skipped: nothing to claim yet (still True: not an error)
    assert tier.contains([key(ids[WAYS])]) == 0
    headers["last_access"][:] = time.time() - 60  # ... long ago
    assert put(tier, ids[WAYS]) and get(tier, ids[WAYS]) == payload(ids[WAYS])
    assert (headers["state"] == READY).sum() == 1
    tier.close()


def test_other_processes_share_the_arena(arena_name):
    """A block written by one process is read by another; the arena outlives its creator."""
    tier = ShmTier(arena_name, PAYLOAD, 64 * PAYLOAD, ttl_s=60)
    put(tier, 1)
    code = textwrap.dedent(f"""
        from tests.kv.store.test_shm_tier import ShmTier, get, put, payload, PAYLOAD
        t = ShmTier({arena_name!r}, PAYLOAD, 1, ttl_s=60)  # attaches: the capacity given is ignored
        assert get(t, 1) == payload(1), "the parent's block"
        assert put(t, 2)
        t.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=repo_python_env())
    assert get(tier, 2) == payload(2)
    assert tier.num_sets * WAYS == 64 // WAYS * WAYS
    tier.close()


def test_a_process_killed_while_reading_holds_no_lock(arena_name):
    """POSIX record locks die with their process: a reader SIGKILLed inside its copy blocks nobody."""
    tier = ShmTier(arena_name, PAYLOAD, 64 * PAYLOAD, ttl_s=60)
    put(tier, 3)
    code = textwrap.dedent(f"""
        import time
        from tests.kv.store.test_shm_tier import ShmTier, key, PAYLOAD
        t = ShmTier({arena_name!r}, PAYLOAD, 1, ttl_s=60)
        # noqa: TID251 - a reader stalled inside its copy (then killed) is the behaviour under test
        t.get(key(3), lambda src: (print("reading", flush=True), time.sleep(60)))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=repo_python_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
        proc.kill()
        proc.wait(timeout=10)
        start = time.monotonic()
        assert put(tier, 3)  # needs the set's lock exclusively
        assert time.monotonic() - start < 1.0
    finally:
        stop(proc)
    tier.close()


def test_a_foreign_file_is_refused(arena_name):
    from kvbaton.kv.store.shm_tier import arena_path

    with open(arena_path(arena_name, PAYLOAD), "wb") as f:
        f.write(b"not an arena" * 1000)
    with pytest.raises(ValueError, match="not a KV store arena"):
        ShmTier(arena_name, PAYLOAD, 64 * PAYLOAD, ttl_s=60)


@pytest.mark.parametrize("name", ["../etc", "", "a/b", ".hidden", "x" * 201])
def test_unsafe_arena_names_are_refused(name):
    with pytest.raises(ValueError, match="shm name"):
        ShmTier(name, PAYLOAD, 64 * PAYLOAD, ttl_s=60)


def _writer(arena_name: str, ids: list[int], fill_s: float) -> subprocess.Popen:
    """Another process putting blocks `ids` in order, each copy taking `fill_s` (a worker writing a step's blocks)."""
    code = textwrap.dedent(f"""
        import time
        from tests.kv.store.test_shm_tier import ShmTier, key, payload, PAYLOAD
        t = ShmTier({arena_name!r}, PAYLOAD, 1, ttl_s=60)
        for n, i in enumerate({ids!r}):
            # noqa: TID251 - a slow writer (each copy takes fill_s) is the behaviour under test
            t.put(key(i), lambda dst, i=i: (time.sleep({fill_s!r}), dst.__setitem__(slice(None), payload(i))))
            if n == 0:
                print("first", flush=True)
        t.close()
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=repo_python_env())


def test_contains_waits_for_blocks_another_worker_is_writing(arena_name):
    """A prefix half written by another process right now is waited for (bounded), not recomputed."""
    tier = ShmTier(arena_name, PAYLOAD, 256 * PAYLOAD, ttl_s=60)
    ids = list(range(100, 130))
    proc = _writer(arena_name, ids, fill_s=0.004)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
        start = time.monotonic()
        assert tier.contains([key(i) for i in ids]) == len(ids)  # the other 29 landed while it waited
        assert time.monotonic() - start < 0.25 + 0.05
        assert all(get(tier, i) == payload(i) for i in ids)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    tier.close()


def test_a_writer_killed_mid_copy_costs_a_short_wait_once(arena_name):
    tier = ShmTier(arena_name, PAYLOAD, 64 * PAYLOAD, ttl_s=60)
    proc = _writer(arena_name, [7, 8], fill_s=60.0)  # claims 7, then sleeps inside its copy
    try:
        def claimed() -> bool:  # the writer has claimed its slot (and is alive)
            assert proc.poll() is None, "the writer exited before it claimed a slot"
            return bool((tier._headers["state"] == WRITING).any())

        wait_until(claimed, 30.0, interval_s=0.01, message="the writer claimed no slot")
        proc.kill()
        proc.wait(timeout=10)
        # past IN_FLIGHT_AGE_S: the dead writer's slot no longer counts as in flight
        writing = tier._headers["state"] == WRITING
        wait_until(lambda: time.time() - tier._headers["last_access"][writing].max() > IN_FLIGHT_AGE_S, 5.0,
                   interval_s=0.01, message="the dead writer's claim did not age")
        start = time.monotonic()
        assert tier.contains([key(7), key(8)]) == 0
        assert time.monotonic() - start < 0.01
    finally:
        stop(proc)
    tier.close()


def test_a_slot_being_written_goes_back_only_when_its_writer_is_gone():
    """A writer stalled mid-copy keeps its slot however long: given to another block, the slot would take the
    stalled writer's bytes over that block's when it woke. A dead writer's slot is free once STALE_S passed."""
    import numpy as np

    from kvbaton.kv.store.shm_tier import HEADER_DTYPE, STALE_S

    now = time.time()
    row = np.zeros(WAYS, HEADER_DTYPE)
    row["state"], row["last_access"], row["expires"] = READY, now, now + 60  # every slot live and recently read
    row[3]["state"], row[3]["last_access"], row[3]["writer"] = WRITING, now - 10 * STALE_S, os.getpid()
    assert ShmTier._victim(row, now) != 3  # stalled for long, but alive: not reclaimed
    row[3]["writer"] = dead_pid()
    assert ShmTier._victim(row, now) == 3  # its writer died mid-copy: the slot is free
    row[3]["last_access"] = now - STALE_S / 2
    assert ShmTier._victim(row, now) != 3  # not yet: a writer may be between its claim and its first bytes
