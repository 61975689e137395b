"""What only the `shm` and `tcp` KV transports have, over real sockets and real shared memory, all on 127.0.0.1:
hostile frames at their ZeroMQ receivers, the shm transport's segments (staging, shared pools, a sender that dies),
and the row copy both use. The contract every transport keeps is tests/kv/test_transport_contract.py.

Variants: "tcp"; "shm" (plain pools: the sender stages each transfer); "shm-shared" (the sender's pools come from
`allocate_shared_pools`: zero-copy); pairs from the `make_pair` fixture (tests/kv/transports.py). Waits are bounded;
every process a test starts is stopped by it.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import pytest
import torch
import zmq

from kvbaton.kv.connectors import ConnectorConfig, make_sender, pool_allocator
from kvbaton.kv.connectors.shm import ShmLayer
from kvbaton.kv.connectors.shm.segments import SHM_DIR
from kvbaton.kv.connectors.tcp import TcpLayer
from kvbaton.kv.connectors.zmq_control import Ack
from kvbaton.kv.pools import KVPools, allocate_pools
from kvbaton.kv.rows import copy_rows
from kvbaton.wire import SignedCodec
from tests.kv.kv_peer import BLOCKS, LAYERS, kv_layout, pool_shape, seeded_pools
from tests.kv.transports import (
    SECRET,
    Log,
    Pair,
    SenderPeer,
    my_segments,
    pump,
    random_ids,
    rows,
    sender_peer_args,
)


@pytest.mark.parametrize("n", [3, 100])  # both ways of finding runs (Python loop, numpy)
def test_copy_rows_matches_indexing(n):
    src, dst = torch.randn(300, 8), torch.zeros(300, 8)
    rng = random.Random(n)
    k = n // 2  # the first k rows consecutive on both sides: one run
    src_ids = list(range(150, 150 + k)) + rng.sample([i for i in range(300) if not 150 <= i < 150 + k], n - k)
    dst_ids = list(range(40, 40 + k)) + rng.sample(range(100, 300), n - k)
    copy_rows(dst.data_ptr(), dst_ids, src.data_ptr(), src_ids, 8 * 4)
    assert torch.equal(dst[dst_ids], src[src_ids])
    assert dst.abs().sum(1).count_nonzero() == n


def test_shared_pool_allocator_gives_zero_copy_senders():
    config = ConnectorConfig("shm", SECRET, worker_name="kvtest-alloc")
    assert pool_allocator(config, sending=False) is allocate_pools  # receivers, and other transports
    assert pool_allocator(ConnectorConfig("tcp", SECRET), sending=True) is allocate_pools
    layout = kv_layout(torch.bfloat16)
    shared = pool_allocator(config, sending=True)(layout, BLOCKS)
    pools, handle = shared.caches, shared.shared
    try:
        assert [p.shape for p in pools] == [pool_shape()] * LAYERS and all(p.is_contiguous() for p in pools)
        assert not any(p.any() for p in pools)
        assert handle.name in my_segments("pool") and "kvtest-alloc" in handle.name
        for kv_pools, zero_copy in ((shared, True), (KVPools(layout, seeded_pools(0, torch.bfloat16)), False)):
            sender = make_sender(ConnectorConfig("shm", SECRET), kv_pools)
            assert sender.zero_copy is zero_copy
            sender.close()
    finally:
        shared.close()
    assert handle.name not in my_segments("pool")
    assert pools[0].add_(1).sum() > 0  # unlinked, but still this process's memory until the tensors go


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_shm_staging_segments_are_kept_for_reuse_and_unlinked_on_close(make_pair, dtype):
    pair = make_pair("shm", dtype, seed=1)
    src, dst = random_ids(random.Random("shm"), 9, 9)
    pair.receiver.expect("a", dst, 10.0)
    pair.send_all("a", src, dst)
    pump(pair.sender, pair.receiver, lambda r, s: r.completed == ["a"] and s.completed == ["a"])
    assert my_segments("stage")
    pair.sender.close()
    assert not my_segments("stage")


class _Evil:
    """Unpickling this creates a file: proof that a receiver never unpickles."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _hostile_frames(pair: Pair, transport: str, marker: Path) -> list[list[bytes]]:
    codec, stranger = SignedCodec(SECRET, object), SignedCodec(b"another-cluster-secret-0123", object)
    layout = pair.sender.layout
    ack_to = pair.sender.ack_address
    if transport == "tcp":
        data = bytes(2 * layout.block_bytes)
        header = TcpLayer("a", 0, layout, ack_to, 2, b"\0" * 32)  # bad data MAC
        layer_frames = [[codec.encode(header), data], [codec.encode(header), data[:-1]]]
        forged = [stranger.encode(header), data]
    else:
        header = ShmLayer("evil", 0, layout, ack_to, os.getpid(), "../../etc/passwd", 0, [0], False)
        layer_frames = [[codec.encode(header)]]  # signed, but names no segment of ours: fails "evil" only
        forged = [stranger.encode(header)]
    return [
        [b"not even msgpack"],
        [pickle.dumps(_Evil(str(marker)))],
        [codec.sign(b"x")[:31]],
        forged,
        [codec.encode(Ack("a", True))],  # signed, but not a message a receiver accepts
        [codec.sign(b"\x81\xa1x\x01") + b"\x81\xa1x\x01"],  # signed {"x": 1}: malformed
        [b"part", b"another part", b"and more"],
        *layer_frames,
    ]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_hostile_frames_are_refused_and_the_receiver_keeps_working(make_pair, transport, tmp_path, caplog):
    pair = make_pair(transport)
    marker = tmp_path / "unpickled"
    src, dst = random_ids(random.Random(7), 6, 6)
    pair.receiver.expect("a", dst, 10.0)
    pair.receiver.expect("evil", [0], 10.0)
    frames = _hostile_frames(pair, transport, marker)
    ctx = zmq.Context()
    try:
        attacker = ctx.socket(zmq.PUSH)
        attacker.connect(pair.receiver.address)
        for message in frames:
            attacker.send_multipart(message)
        big = ctx.socket(zmq.PUSH)  # libzmq drops a connection that sends a frame over the limit
        big.connect(pair.receiver.address)
        big.send(bytes(pair.receiver.max_frame_bytes() + 1))
        expected_refusals = len(frames) - (1 if transport == "shm" else 0)  # shm: "evil" fails instead

        def all_seen(r: Log, s: Log) -> bool:
            refusals = sum("refused" in rec.message for rec in caplog.records)
            return refusals >= expected_refusals and (transport == "tcp" or "evil" in r.failed)

        rlog, _ = pump(None, pair.receiver, all_seen)
        if transport == "shm":
            assert "refusing shared memory segment name" in rlog.failed["evil"]
        pair.send_all("a", src, dst)
        rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: "a" in r.completed and "a" in s.completed)
        assert all(torch.equal(rows(pair.dst, layer, dst), rows(pair.src, layer, src)) for layer in range(LAYERS))
        assert not marker.exists()
    finally:
        ctx.destroy(linger=0)


def test_shm_sender_death_fails_the_transfer_and_frees_its_segment(make_pair, tmp_path):
    pair = make_pair("shm")  # for the follow-up transfer
    src, dst = random_ids(random.Random(9), 6, 6)
    pair.receiver.expect("x", dst, 30.0)
    peer = SenderPeer(tmp_path, make_pair.peer_env("shm"),
                      *sender_peer_args("shm", pair.receiver.address, 12, src, dst, "--shared", "--layers", "2",
                                        "--then", "hang"))
    try:
        segment = peer.event("ready")["segment"]
        expected = seeded_pools(12, torch.bfloat16)
        pump(None, pair.receiver, lambda r, s: torch.equal(rows(pair.dst, 1, dst), rows(expected, 1, src)),
             timeout_s=30.0)
        peer.stop()  # SIGKILL: no close(), no unlink
        rlog, _ = pump(None, pair.receiver, lambda r, s: "x" in r.failed)
        assert f"prefill worker process {peer.proc.pid} is gone" in rlog.failed["x"]
        # the receiver keeps working
        pair.receiver.expect("y", dst, 10.0)
        pair.send_all("y", src, dst)
        pump(pair.sender, pair.receiver, lambda r, s: "y" in r.completed and "y" in s.completed)
        # the dead peer's resource tracker unlinks what it left
        pump(None, None, lambda r, s: not os.path.exists(os.path.join(SHM_DIR, segment)), timeout_s=10.0)
    finally:
        peer.stop()
