"""What a killed `kvbaton serve` left behind, removed when the next one starts (`sweep`).

A SIGKILL reaches no `finally`, so the private servers' temp dirs and the KV store's shm arena stay
(their processes do not: see `kvbaton.worker.lifeline`, `kvbaton.cluster.guard`). What goes, only
of this user and never through a symlink:

    <tmp>/kvbaton-redis-*, kvbaton-mooncake-*, kvbray-*   whose recorded owner is gone (`kv.owner`)
    /dev/shm/kvb-store-serve-<pid>-*                     whose server is gone, mapped by no live process
    /dev/shm/kvb-*.<pid>.<tid>.tmp                       a half-made arena whose maker is gone

What stays: a dir without an owner record (made by something else, or before the record existed),
an operator-named arena (`--kv-store-shm-name`: shared on purpose, owned by no process), and anything
whose owner lives.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvbaton.kv.owner import PREFIXES, is_alive, read_owner, start_ticks
from kvbaton.kv.store.shm_tier import SHM_DIR, arena_owner, has_arena_header

logger = logging.getLogger(__name__)

ARENA_PREFIX = "kvb-"
HALF_MADE_SUFFIX = ".tmp"


def sweep(temp_roots: Sequence[str | Path] | None = None, shm_dir: str | Path = SHM_DIR) -> list[Path]:
    """Remove this user's leftovers in `temp_roots` (default: the temp dir and /tmp) and `shm_dir`; the paths
    removed, each logged at INFO. A leftover that cannot be removed is logged and skipped."""
    roots = temp_roots if temp_roots is not None else sorted({tempfile.gettempdir(), "/tmp"})
    removed = [path for root in roots for path in _sweep_temp_dirs(Path(root))]
    return removed + _sweep_arenas(Path(shm_dir))


def _ours(directory: Path, prefixes: tuple[str, ...]) -> Iterator[os.DirEntry[str]]:
    """The entries of `directory` named with one of `prefixes` that belong to this user (symlinks as themselves)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.name.startswith(prefixes) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                yield entry
        except FileNotFoundError:  # removed meanwhile
            continue


def _sweep_temp_dirs(root: Path) -> list[Path]:
    removed = []
    for entry in _ours(root, PREFIXES):
        path, owner = Path(entry.path), None
        if entry.is_dir(follow_symlinks=False):
            owner = read_owner(path)
        if owner is None or is_alive(owner):
            continue
        # NOTE: rmtree follows no symlink inside the tree (it refuses one at the top, checked above anyway)
        if _remove(path, shutil.rmtree):
            logger.info("removed %s, left by pid %d", path, owner.pid)
            removed.append(path)
    return removed


def _sweep_arenas(shm_dir: Path) -> list[Path]:
    removed, mapped = [], None
    for entry in _ours(shm_dir, (ARENA_PREFIX,)):
        pid = arena_owner(entry.name)
        if pid is None or start_ticks(pid) is not None or not entry.is_file(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if not entry.name.endswith(HALF_MADE_SUFFIX):  # a half-made arena is mapped by nobody
            # NOTE: an arena records no users, and a worker may outlive its server for a moment
            # (`lifeline`): in use is what some live process maps. Only this user's processes can map it
            # (0600), and only theirs can we see: /proc/<pid>/maps of another user is unreadable.
            mapped = _mapped_paths() if mapped is None else mapped
            if str(path) in mapped or not _is_arena(path):
                continue
        if _remove(path, os.unlink):
            logger.info("removed %s, left by pid %d", path, pid)
            removed.append(path)
    return removed


def _is_arena(path: Path) -> bool:
    """A regular file of ours that starts with an arena's superblock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and has_arena_header(fd)
    finally:
        os.close(fd)


def _mapped_paths() -> set[str]:
    """The files mapped by the live processes whose maps we may read."""
    paths = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            maps = Path(entry.path, "maps").read_text(errors="replace")
        except OSError:  # gone, or another user's
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6:
                paths.add(fields[5])
    return paths


def _remove(path: Path, remove: Callable[[Path], object]) -> bool:
    try:
        remove(path)
    except FileNotFoundError:  # another server's janitor was first
        return False
    except OSError as exc:
        logger.warning("cannot remove the leftover %s: %s", path, exc)
        return False
    return True
