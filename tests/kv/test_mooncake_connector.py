"""The mooncake KV transport with real Mooncake Transfer Engines (tcp protocol, P2P handshake,
127.0.0.1)."""

from __future__ import annotations

import random
import secrets
import time

import kv_receiver_peer as peer  # noqa: E402

# NOTE: no skip: the test extra installs mooncake-transfer-engine-non-cuda and scripts/setup.sh its
# libibverbs1; an import error here is a set-up failure to see.
import mooncake.engine  # noqa: E402, F401
import msgspec
import pytest
import torch
import zmq

from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver, make_sender  # noqa: E402
from kvbaton.kv.connectors.mooncake import LayerReady, Offer, ToReceiver  # noqa: E402
from kvbaton.kv.connectors.mooncake.engine import PROTOCOL_ENV  # noqa: E402
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch  # noqa: E402
from kvbaton.kv.pools import KVPools  # noqa: E402
from kvbaton.kv.rows import contiguous_runs  # noqa: E402
from kvbaton.wire import SECRET_ENV, SignedCodec  # noqa: E402

SECRET = secrets.token_hex(16).encode()
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv(PROTOCOL_ENV, "tcp")


@pytest.fixture
def connectors():
    """make(dtype) -> (sender, receiver, src pools, dst pools); everything is closed after the test."""
    made = []

    def make(dtype: torch.dtype = torch.bfloat16):
        config = ConnectorConfig("mooncake", SECRET, worker_name="t")
        src, dst = peer.pools(dtype, seed=len(made)), peer.pools(dtype)
        layout = peer.kv_layout(dtype)
        pair = (make_sender(config, KVPools(layout, src)), make_receiver(config, KVPools(layout, dst)), src, dst)
        made.append(pair)
        return pair

    yield make
    for sender, receiver, _, _ in made:
        sender.close()
        receiver.close()


def blocks(seed: int, n: int = 6) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(peer.BLOCKS), n), rng.sample(range(peer.BLOCKS), n)


def spec(request_id: str, src: list[int], dst: list[int], receiver: str, layout: KVLayout,
         deadline_s: float = 10.0) -> TransferSpec:
    return TransferSpec(request_id=request_id, src_block_ids=src, dst_block_ids=dst, receiver=receiver,
                        layout=layout, deadline_s=deadline_s)


def send_all(sender, request_id: str, src_ids, dst_ids, receiver_address: str, deadline_s: float = 10.0) -> None:
    sender.begin(spec(request_id, src_ids, dst_ids, receiver_address, sender.layout, deadline_s))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, [request_id])


def assert_moved(src, dst, src_ids, dst_ids) -> None:
    for got, want in zip(peer.rows(dst, dst_ids), peer.rows(src, src_ids)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_land_only_after_the_last_layer(connectors, dtype):
    sender, receiver, src, dst = connectors(dtype)
    src_ids, dst_ids = blocks(1)
    src_ids[1:3] = [20, 21]  # a run contiguous on both sides: one read for two blocks
    dst_ids[1:3] = [30, 31]
    receiver.expect("a", dst_ids, 10.0)
    sender.begin(spec("a", src_ids, dst_ids, receiver.address, sender.layout))
    for layer in range(peer.LAYERS - 1):
        sender.save_layer(layer, ["a"])
    s, r = peer.poll_for([sender, receiver], 0.4)
    assert not (s.completed or s.failed or r.completed or r.failed)
    assert not dst[-1].any()

    sender.save_layer(peer.LAYERS - 1, ["a"])
    time.sleep(0.2)
    assert not dst[-1].any()  # the receiver reads inside poll(), never behind the engine's back
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("a") and r.ended("a"))
    assert s.completed == {"a"} and r.completed == {"a"}
    assert_moved(src, dst, src_ids, dst_ids)
    assert peer.others_zero(dst, dst_ids)


def test_sender_and_receiver_in_different_processes():
    src_ids, dst_ids = blocks(2, n=10)
    proc = peer.spawn("mooncake", list(DTYPES), dst_ids, {SECRET_ENV: SECRET.decode(), PROTOCOL_ENV: "tcp"})
    config = ConnectorConfig("mooncake", SECRET)
    srcs = {name: peer.pools(dtype, seed=7) for name, dtype in DTYPES.items()}
    senders = {name: make_sender(config, KVPools(peer.kv_layout(DTYPES[name]), src)) for name, src in srcs.items()}
    try:
        ready = peer.read_event(proc, 30.0)
        for name, sender in senders.items():
            send_all(sender, f"x-{name}", src_ids, dst_ids, ready["addresses"][name])
        outcomes = peer.poll_until(list(senders.values()), lambda *o: all(x.completed or x.failed for x in o))
        done = peer.read_event(proc, 15.0)
    finally:
        for sender in senders.values():
            sender.close()
        proc.kill()
        proc.wait(5)
    for name, outcome in zip(senders, outcomes):
        assert outcome.completed == {f"x-{name}"}  # the receiver confirmed
        assert done[name]["completed"] == [f"x-{name}"] and done[name]["others_zero"]
        assert done[name]["digests"] == peer.digests(srcs[name], src_ids)


def test_deadlines_fail_both_sides(connectors):
    sender, receiver, src, dst = connectors()
    src_ids, dst_ids = blocks(3)
    receiver.expect("lonely", dst_ids, 0.3)  # nothing will ever come
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as deaf:  # a "receiver" that never answers
        deaf.setsockopt(zmq.LINGER, 0)
        port = deaf.bind_to_random_port("tcp://127.0.0.1")
        send_all(sender, "unheard", src_ids, dst_ids, f"tcp://127.0.0.1:{port}", deadline_s=0.3)
        s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("unheard") and r.ended("lonely"))
    assert "did not confirm within 0.3 s" in s.failed["unheard"]
    assert "within 0.3 s (0/4 layers read)" in r.failed["lonely"]
    assert not any(p.any() for p in dst)


def test_cancel_and_abort(connectors):
    sender, receiver, src, dst = connectors()
    src_ids, dst_ids = blocks(4)
    receiver.expect("cancelled", dst_ids, 10.0)
    receiver.cancel("cancelled")
    send_all(sender, "cancelled", src_ids, dst_ids, receiver.address)
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("cancelled"))
    assert "cancelled" in s.failed["cancelled"]  # told at once, not at its deadline
    assert not r.completed and not r.failed and not any(p.any() for p in dst)

    receiver.expect("aborted", dst_ids, 10.0)
    sender.begin(spec("aborted", src_ids, dst_ids, receiver.address, sender.layout))
    sender.abort("aborted")
    s, r = peer.poll_until([sender, receiver], lambda s, r: r.ended("aborted"))
    assert "aborted by the prefill worker" in r.failed["aborted"]
    assert not (s.completed or s.failed)  # abort() is not reported
    assert not any(p.any() for p in dst)


def test_forged_frames_are_refused_and_the_receiver_keeps_working(connectors):
    sender, receiver, src, dst = connectors()
    src_ids, dst_ids = blocks(5)
    receiver.expect("f", dst_ids, 10.0)
    bogus = Offer("f", "127.0.0.1:1", sender.layout, peer.BLOCKS, [0] * peer.LAYERS, src_ids, dst_ids)
    unsigned = msgspec.msgpack.encode(bogus)
    wrong_secret = SignedCodec(b"not-the-cluster-secret", ToReceiver).encode(bogus)
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as attacker:
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(receiver.address)
        for frame in (b"junk", unsigned, b"\0" * 32 + unsigned, wrong_secret):
            attacker.send(frame)
        attacker.send_multipart([b"two", b"parts"])
        attacker.send(SignedCodec(b"not-the-cluster-secret", ToReceiver).encode(LayerReady(["f"], 0)))
        (r,) = peer.poll_for([receiver], 0.4)
    assert not r.completed and not r.failed  # refused and logged; "f" is still expected

    send_all(sender, "f", src_ids, dst_ids, receiver.address)
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("f") and r.ended("f"))
    assert s.completed == {"f"} and r.completed == {"f"}
    assert_moved(src, dst, src_ids, dst_ids)


def test_a_bad_offer_fails_alone(connectors):
    """A signed offer naming memory the sender never registered: Mooncake refuses the read; that
    request fails, a good one read in the same poll completes, and both senders hear of it."""
    sender, receiver, src, dst = connectors()
    src_ids, dst_ids = blocks(6)
    good_dst, bad_dst = dst_ids[:3], dst_ids[3:]
    receiver.expect("good", good_dst, 10.0)
    receiver.expect("bad", bad_dst, 10.0)
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as liar:
        liar.setsockopt(zmq.LINGER, 0)
        liar.connect(receiver.address)
        codec = SignedCodec(SECRET, ToReceiver)
        session = sender._engine.session  # a live engine, asked for addresses it never registered
        liar.send(codec.encode(Offer("bad", session, sender.layout, peer.BLOCKS, [4096] * peer.LAYERS, src_ids[3:],
                                     bad_dst)))
        for layer in range(peer.LAYERS):
            liar.send(codec.encode(LayerReady(["bad"], layer)))
        send_all(sender, "good", src_ids[:3], good_dst, receiver.address)
        s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("good") and r.ended("bad"))
        assert liar.poll(2000), "the liar got no answer"
        assert b"Failed" in liar.recv()
    assert s.completed == {"good"} and r.completed == {"good"}
    assert "Mooncake read" in r.failed["bad"]
    assert_moved(src, dst, src_ids[:3], good_dst)


def test_refusals(connectors, monkeypatch):
    sender, receiver, src, dst = connectors()
    other = KVLayout.standard(num_layers=peer.LAYERS, block_size=peer.BLOCK * 2, num_kv_heads=peer.HEADS,
                              head_dim=peer.DIM, dtype="bfloat16")
    with pytest.raises(KVLayoutMismatch, match="block_size"):
        sender.begin(spec("e", [0], [0], receiver.address, other))
    receiver.expect("moved", [1, 2], 10.0)  # the sender was told other destination blocks
    send_all(sender, "moved", [1, 2], [2, 3], receiver.address)
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("moved") and r.ended("moved"))
    assert "destination blocks differ" in r.failed["moved"] and "destination blocks differ" in s.failed["moved"]
    assert not any(p.any() for p in dst)
    monkeypatch.setenv(PROTOCOL_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match=PROTOCOL_ENV):
        make_receiver(ConnectorConfig("mooncake", SECRET), KVPools(sender.layout, dst))


def test_contiguous_runs():
    assert contiguous_runs([4, 5, 6, 9, 1], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 1), (1, 4, 1)]
    assert contiguous_runs([], []) == []
