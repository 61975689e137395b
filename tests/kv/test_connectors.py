"""The `shm` and `tcp` KV transports over real sockets and real shared memory, all on 127.0.0.1.

Variants: "tcp"; "shm" (plain pools: the sender stages each transfer); "shm-shared" (the sender's
pools come from `allocate_shared_pools`: zero-copy). Waits are bounded; every process a test
starts is stopped by it.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import zmq
from kv_peer import BLOCKS, DIM, LAYERS, kv_layout, pool_shape, seeded_pools

from kvbaton.kv.connectors import (
    ConnectorConfig,
    KVReceiver,
    KVSender,
    TransferSpec,
    make_receiver,
    make_sender,
    pool_allocator,
)
from kvbaton.kv.connectors.shm import ShmLayer
from kvbaton.kv.connectors.shm.segments import SHM_DIR
from kvbaton.kv.connectors.tcp import TcpLayer
from kvbaton.kv.connectors.zmq import NOT_EXPECTING, Ack
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from kvbaton.kv.pools import KVPools, allocate_pools
from kvbaton.kv.rows import copy_rows
from kvbaton.wire import SECRET_ENV, SignedCodec

SECRET = b"kvbaton-test-secret-0123456789ab"
VARIANTS = ["tcp", "shm", "shm-shared"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PEER = Path(__file__).with_name("kv_peer.py")


@dataclass
class Pair:
    sender: KVSender
    receiver: KVReceiver
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    closers: list[Callable[[], None]]

    def spec(self, request_id: str, src: list[int], dst: list[int], deadline_s: float = 10.0,
             layout: KVLayout | None = None) -> TransferSpec:
        return TransferSpec(request_id=request_id, src_block_ids=src, dst_block_ids=dst, receiver=self.receiver.address,
                            layout=layout or self.receiver.layout, deadline_s=deadline_s)


@pytest.fixture
def make_pair():
    pairs: list[Pair] = []

    def make(variant: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, recv_dim: int = DIM) -> Pair:
        config = ConnectorConfig(variant.split("-")[0], SECRET, worker_name="kvtest")
        if variant == "shm-shared":  # what a shm prefill worker allocates: pools in shared memory
            src = pool_allocator(config, sending=True)(kv_layout(dtype), BLOCKS)
            seeded_pools(seed, dtype, out=src.caches)
        else:
            src = KVPools(kv_layout(dtype), seeded_pools(seed, dtype))
        dst = allocate_pools(kv_layout(dtype, head_dim=recv_dim), BLOCKS)  # zeros
        receiver = make_receiver(config, dst)
        sender = make_sender(config, src)
        pair = Pair(sender, receiver, src.caches, dst.caches, [sender.close, receiver.close, src.close])
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        for close in pair.closers:
            close()


@dataclass
class Log:
    completed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, result) -> None:
        self.completed += result.completed
        self.failed.update(result.failed)


def pump(sender: KVSender | None, receiver: KVReceiver | None, until: Callable[[Log, Log], bool],
         timeout_s: float = 5.0) -> tuple[Log, Log]:
    """Poll both sides until `until(receiver_log, sender_log)`, for at most `timeout_s`."""
    rlog, slog = Log(), Log()
    deadline = time.monotonic() + timeout_s
    while not until(rlog, slog):
        assert time.monotonic() < deadline, f"timed out: receiver {rlog}, sender {slog}"
        time.sleep(0.002)
        if receiver is not None:
            rlog.add(receiver.poll())
        if sender is not None:
            slog.add(sender.poll())
    return rlog, slog


def rows(pools: list[torch.Tensor], layer: int, ids: list[int]) -> torch.Tensor:
    return pools[layer].view(BLOCKS, -1)[ids]


def random_ids(rng: random.Random, *sizes: int) -> list[list[int]]:
    """Disjoint random block-id lists."""
    ids = rng.sample(range(BLOCKS), sum(sizes))
    return [ids[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]


def my_segments(kind: str = "", pid: int | None = None) -> list[str]:
    mark = f"-{pid or os.getpid()}-{kind}"
    return [name for name in os.listdir(SHM_DIR) if name.startswith("kvb-") and mark in name]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_transfer_moves_every_layer(make_pair, variant, dtype):
    pair = make_pair(variant, dtype, seed=1)
    rng = random.Random(variant)
    src_a, src_b = random_ids(rng, 9, 5)
    dst_a, dst_b, _ = random_ids(rng, 9, 5, 0)
    for request_id, src, dst in (("a", src_a, dst_a), ("b", src_b, dst_b)):
        pair.receiver.expect(request_id, dst, 10.0)
        pair.sender.begin(pair.spec(request_id, src, dst))
    for layer in range(LAYERS):
        pair.sender.save_layer(layer, ["a", "not-transferring", "b"])
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: len(r.completed) == 2 and len(s.completed) == 2)
    assert sorted(rlog.completed) == sorted(slog.completed) == ["a", "b"] and not rlog.failed and not slog.failed
    untouched = sorted(set(range(BLOCKS)) - set(dst_a) - set(dst_b))
    for layer in range(LAYERS):
        assert torch.equal(rows(pair.dst, layer, dst_a), rows(pair.src, layer, src_a))
        assert torch.equal(rows(pair.dst, layer, dst_b), rows(pair.src, layer, src_b))
        assert not rows(pair.dst, layer, untouched).any()
    if variant == "shm":  # staging segments are kept for reuse, and unlinked on close
        assert my_segments("stage")
        pair.sender.close()
        assert not my_segments("stage")


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


@pytest.mark.parametrize("variant", VARIANTS)
def test_layers_arrive_one_by_one(make_pair, variant):
    pair = make_pair(variant)
    src, dst = random_ids(random.Random(2), 6, 6)
    pair.receiver.expect("a", dst, 10.0)
    pair.sender.begin(pair.spec("a", src, dst))
    pair.sender.save_layer(0, ["a"])
    rlog, slog = pump(pair.sender, pair.receiver,
                      lambda r, s: torch.equal(rows(pair.dst, 0, dst), rows(pair.src, 0, src)))
    assert not (rlog.completed or slog.completed or rlog.failed or slog.failed)
    assert not rows(pair.dst, 1, dst).any()
    for layer in range(1, LAYERS):
        pair.sender.save_layer(layer, ["a"])
    pump(pair.sender, pair.receiver, lambda r, s: r.completed == ["a"] and s.completed == ["a"])
    assert all(torch.equal(rows(pair.dst, layer, dst), rows(pair.src, layer, src)) for layer in range(LAYERS))


@pytest.mark.parametrize("variant", ["tcp", "shm"])
def test_deadline_fails_both_sides(make_pair, variant):
    pair = make_pair(variant)
    src, dst = random_ids(random.Random(3), 4, 4)
    pair.receiver.expect("a", dst, deadline_s=0.4)
    pair.sender.begin(pair.spec("a", src, dst, deadline_s=0.4))
    pair.sender.save_layer(0, ["a"])  # the other layers never come
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: "a" in r.failed and "a" in s.failed)
    assert "within 0.4s (1/4 layers)" in rlog.failed["a"]
    assert "0.4s" in slog.failed["a"]  # its own deadline or the receiver's word, whichever came first


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_unreachable_receiver_fails_by_deadline(transport):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = kv_layout(torch.bfloat16)
    sender = make_sender(ConnectorConfig(transport, SECRET), KVPools(layout, seeded_pools(0, torch.bfloat16)))
    try:
        sender.begin(TransferSpec(request_id="a", src_block_ids=[1, 2], dst_block_ids=[3, 4],
                                  receiver=f"tcp://127.0.0.1:{port}", layout=layout, deadline_s=0.3))
        for layer in range(LAYERS):
            sender.save_layer(layer, ["a"])
        _, slog = pump(sender, None, lambda r, s: "a" in s.failed)
        assert "no confirmation from the decode worker within 0.3s (4/4 layers sent)" in slog.failed["a"]
    finally:
        sender.close()


@pytest.mark.parametrize("variant", ["tcp", "shm-shared"])
def test_cancel_drops_late_data_and_tells_the_sender(make_pair, variant):
    pair = make_pair(variant)
    src_a, src_b, dst_a, dst_b = random_ids(random.Random(4), 5, 5, 5, 5)
    pair.receiver.expect("a", dst_a, 10.0)
    pair.receiver.expect("b", dst_b, 10.0)
    pair.receiver.cancel("b")  # before any data
    pair.sender.begin(pair.spec("a", src_a, dst_a))
    pair.sender.begin(pair.spec("b", src_b, dst_b))
    pair.sender.save_layer(0, ["a", "b"])
    rlog0, early = pump(pair.sender, pair.receiver,
                        lambda r, s: torch.equal(rows(pair.dst, 0, dst_a), rows(pair.src, 0, src_a)))
    pair.receiver.cancel("a")  # midway
    for layer in range(1, LAYERS):
        pair.sender.save_layer(layer, ["a", "b"])
    # NOTE: "b"'s nack may already have reached the sender while layer 0 of "a" was awaited
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: {"a", "b"} <= set(s.failed) | set(early.failed))
    slog.failed.update(early.failed)
    assert not (rlog0.completed or rlog0.failed)
    assert "cancelled by the decode worker" in slog.failed["a"]
    assert NOT_EXPECTING in slog.failed["b"]
    rlog2, _ = pump(None, pair.receiver, lambda r, s: True)
    assert not (rlog.completed or rlog.failed or rlog2.completed or rlog2.failed)
    assert not rows(pair.dst, LAYERS - 1, dst_a).any() and not rows(pair.dst, 0, dst_b).any()


@pytest.mark.parametrize("variant", ["tcp", "shm"])
def test_abort_tells_the_receiver(make_pair, variant):
    pair = make_pair(variant)
    src, dst = random_ids(random.Random(5), 5, 5)
    pair.receiver.expect("a", dst, 10.0)
    pair.sender.begin(pair.spec("a", src, dst))
    pair.sender.save_layer(0, ["a"])
    pair.sender.abort("a")
    pair.sender.save_layer(1, ["a"])  # no longer ours: ignored
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: "a" in r.failed)
    assert "aborted by the prefill worker" in rlog.failed["a"]
    assert not (slog.completed or slog.failed)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_layout_mismatch_is_refused_on_both_sides(make_pair, transport):
    pair = make_pair(transport, recv_dim=2 * DIM)
    src, dst = random_ids(random.Random(6), 4, 4)
    pair.receiver.expect("a", dst, 10.0)
    with pytest.raises(KVLayoutMismatch, match=f"head_dim {DIM} vs {2 * DIM}"):
        pair.sender.begin(pair.spec("a", src, dst))
    rlog, _ = pump(pair.sender, pair.receiver, lambda r, s: "a" in r.failed)
    assert "KV layout mismatch" in rlog.failed["a"] and "--block-size" in rlog.failed["a"]
    # a spec that misstates the receiver's layout: the receiver checks each layer message itself
    pair.receiver.expect("b", dst, 10.0)
    pair.sender.begin(pair.spec("b", src, dst, layout=pair.sender.layout))
    for layer in range(LAYERS):
        pair.sender.save_layer(layer, ["b"])
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: "b" in r.failed and "b" in s.failed)
    assert "KV layout mismatch" in rlog.failed["b"] and "KV layout mismatch" in slog.failed["b"]
    assert not any(pool.any() for pool in pair.dst)


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
        pair.sender.begin(pair.spec("a", src, dst))
        for layer in range(LAYERS):
            pair.sender.save_layer(layer, ["a"])
        rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: "a" in r.completed and "a" in s.completed)
        assert all(torch.equal(rows(pair.dst, layer, dst), rows(pair.src, layer, src)) for layer in range(LAYERS))
        assert not marker.exists()
    finally:
        ctx.destroy(linger=0)


class Peer:
    """kv_peer.py in a subprocess; its stdout events are read on a thread so waits stay bounded."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.stderr_path = tmp_path / "peer.err"
        env = {**os.environ, SECRET_ENV: SECRET.decode()}
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE, stderr=err,
                                         env=env, text=True)
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        import json

        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def event(self, name: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [e for e in self.events if e["event"] == name]
            if found:
                return found[0]
            assert self.proc.poll() is None or self.events, f"peer exited: {self.stderr_path.read_text()}"
            time.sleep(0.01)
        raise AssertionError(f"no {name!r} from the peer within {timeout_s}s: {self.stderr_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _peer_args(transport: str, address: str, seed: int, src: list[int], dst: list[int], *extra: str) -> list[str]:
    return ["--transport", transport, "--address", address, "--seed", str(seed),
            "--src", ",".join(map(str, src)), "--dst", ",".join(map(str, dst)), *extra]


@pytest.mark.parametrize("variant", ["shm-shared", "tcp"])
def test_sender_in_another_process(variant, tmp_path):
    transport, seed = variant.split("-")[0], 11
    pools = allocate_pools(kv_layout(torch.bfloat16), BLOCKS)
    dst_pools = pools.caches
    receiver = make_receiver(ConnectorConfig(transport, SECRET), pools)
    src, dst = random_ids(random.Random(8), 12, 12)
    receiver.expect("x", dst, 30.0)
    extra = ["--shared"] if variant == "shm-shared" else []
    peer = Peer(tmp_path, *_peer_args(transport, receiver.address, seed, src, dst, *extra))
    try:
        pump(None, receiver, lambda r, s: r.completed == ["x"], timeout_s=30.0)
        assert peer.event("done")["completed"] == ["x"]
        assert peer.proc.wait(10) == 0
        expected = seeded_pools(seed, torch.bfloat16)
        assert all(torch.equal(rows(dst_pools, layer, dst), rows(expected, layer, src)) for layer in range(LAYERS))
        assert not my_segments(pid=peer.proc.pid)  # the peer unlinked its pool on close
    finally:
        peer.stop()
        receiver.close()


def test_shm_sender_death_fails_the_transfer_and_frees_its_segment(make_pair, tmp_path):
    pair = make_pair("shm")  # for the follow-up transfer
    src, dst = random_ids(random.Random(9), 6, 6)
    pair.receiver.expect("x", dst, 30.0)
    peer = Peer(tmp_path, *_peer_args("shm", pair.receiver.address, 12, src, dst, "--shared", "--layers", "2",
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
        pair.sender.begin(pair.spec("y", src, dst))
        for layer in range(LAYERS):
            pair.sender.save_layer(layer, ["y"])
        pump(pair.sender, pair.receiver, lambda r, s: "y" in r.completed and "y" in s.completed)
        # the dead peer's resource tracker unlinks what it left
        pump(None, None, lambda r, s: not os.path.exists(os.path.join(SHM_DIR, segment)), timeout_s=10.0)
    finally:
        peer.stop()
