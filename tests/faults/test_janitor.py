"""The start-up janitor (`kvbaton.cluster.janitor`): what a killed server left goes, what a live process owns stays.

Leftovers are made the way the servers make them, by real processes that then exit (or by a PID that has
exited); the arenas are real ones in /dev/shm, removed again at the end whatever happened."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.cluster.janitor import sweep
from kvbaton.kv.owner import MOONCAKE_PREFIX, PREFIXES, RAY_PREFIX, REDIS_PREFIX, Owner, owned_temp_dir, write_owner
from kvbaton.kv.store.shm_tier import SHM_DIR, ShmTier, arena_owner, arena_path, serve_arena_name
from tests.support.procs import repo_python_env

PAYLOAD = 4096
CAPACITY = 16 * PAYLOAD  # one set of an arena


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def dirs_of_an_exited_process(root: Path) -> list[Path]:
    """One temp dir of each kind, made (owner recorded) by a process that has exited since."""
    code = ("import sys; from kvbaton.kv.owner import PREFIXES, owned_temp_dir\n"
            "for prefix in PREFIXES: print(owned_temp_dir(prefix, sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(root)], env=repo_python_env(), check=True,
                         capture_output=True, text=True).stdout
    return [Path(line) for line in out.splitlines()]


def test_temp_dirs_of_a_gone_owner_go_and_the_rest_stays(tmp_path, caplog):
    root = tmp_path / "tmp"
    root.mkdir()
    leftovers = dirs_of_an_exited_process(root)
    assert [p.name[:len(prefix)] for p, prefix in zip(leftovers, PREFIXES)] == list(PREFIXES)
    (leftovers[0] / "redis.log").write_text("a server's log goes with its dir")
    reused = owned_temp_dir(RAY_PREFIX, str(root))
    rewrite_owner(reused, Owner(os.getpid(), 1))  # this PID, but another start time: a reused PID
    live = owned_temp_dir(MOONCAKE_PREFIX, str(root))
    unowned = root / f"{REDIS_PREFIX}made-before-owners"
    unowned.mkdir()
    other = owned_temp_dir("not-ours-", str(root))  # an owner record, but none of our prefixes
    rewrite_owner(other, Owner(dead_pid(), 1))
    outside = owned_temp_dir(REDIS_PREFIX, str(tmp_path))  # a dead owner's dir, in the root only through a link
    rewrite_owner(outside, Owner(dead_pid(), 1))
    link = root / f"{RAY_PREFIX}link"
    link.symlink_to(outside)
    with caplog.at_level(logging.INFO, logger="kvbaton.cluster.janitor"):
        removed = sweep(temp_roots=[root], shm_dir=tmp_path / "no-shm")
    assert sorted(removed) == sorted([*leftovers, reused])
    assert not any(p.exists() for p in removed)
    assert all(p.exists() for p in (live, unowned, other, link, outside / "owner"))
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbaton.cluster.janitor"]
    assert sorted(line.split(",")[0] for line in lines) == sorted(f"removed {p}" for p in removed)  # one each


def rewrite_owner(directory: Path, owner: Owner) -> None:
    (directory / "owner").unlink()
    write_owner(directory, owner)


def test_arenas_of_a_gone_server_go_unless_mapped_and_the_rest_stays():
    dead = dead_pid()
    names = {kind: f"serve-{dead}-{secrets.token_hex(3)}" for kind in ("left", "mapped", "not-an-arena")}
    names["live"] = serve_arena_name()  # this process's
    names["operator"] = f"janitor-test-{secrets.token_hex(3)}"  # --kv-store-shm-name: shared, no owner
    paths = {kind: Path(arena_path(name, PAYLOAD)) for kind, name in names.items()}
    assert arena_owner(paths["live"].name) == os.getpid() and arena_owner(paths["operator"].name) is None
    half_made = Path(f"{paths['left']}.{dead}.{dead}.tmp")
    tiers = {kind: ShmTier(name, PAYLOAD, CAPACITY, ttl_s=60) for kind, name in names.items() if kind != "not-an-arena"}
    try:
        for kind in ("left", "live", "operator"):
            tiers.pop(kind).close()  # unmapped; "mapped" stays mapped by this process
        paths["not-an-arena"].write_bytes(b"\0" * PAYLOAD)
        half_made.write_bytes(b"")
        sweep(temp_roots=[])
        # NOTE: gone, not "in what this sweep removed": /dev/shm is the machine's, and a `serve` that another test
        # starts meanwhile sweeps it too
        assert not paths["left"].exists() and not half_made.exists()
        assert all(paths[k].exists() for k in ("mapped", "live", "operator", "not-an-arena"))
    finally:
        for tier in tiers.values():
            tier.close()
        for path in [*paths.values(), half_made]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_live_servers_dir_is_never_a_leftover(tmp_path, prefix):
    path = owned_temp_dir(prefix, str(tmp_path))
    assert sweep(temp_roots=[tmp_path], shm_dir=SHM_DIR + "/nonexistent") == [] and path.is_dir()
