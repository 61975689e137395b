"""A shm receiver maps only segments this user owns, and never through a symlink: /dev/shm is
world-writable, so another user could otherwise plant a segment under a name we will open."""

from __future__ import annotations

import os
import uuid

import pytest

from kvbaton.kv.connectors.shm.segments import SHM_DIR, Segment


def _path() -> tuple[str, str]:
    name = f"kvb-test-{uuid.uuid4().hex[:12]}"
    return name, os.path.join(SHM_DIR, name)


def test_own_segment_attaches():
    name, _ = _path()
    segment = Segment.create(name, 4096)
    try:
        attached = Segment.attach(name)
        assert attached.size == 4096
        attached.close()
    finally:
        segment.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_another_users_segment_is_refused():
    name, path = _path()
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        os.chown(path, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            Segment.attach(name)
    finally:
        os.unlink(path)


def test_a_symlink_in_place_of_a_segment_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 4096)
    name, path = _path()
    os.symlink(target, path)
    try:
        with pytest.raises(OSError):
            Segment.attach(name)
    finally:
        os.unlink(path)
