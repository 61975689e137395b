"""What only the mooncake KV transport has, with real Mooncake Transfer Engines (tcp protocol, P2P handshake,
127.0.0.1): an offer of memory the sender never registered, offers for other destination blocks, the protocol
setting, and the runs its reads are batched by. The contract every transport keeps is
tests/kv/test_transport_contract.py; pairs come from the `make_pair` fixture (tests/kv/transports.py), which sets
the tcp protocol."""

from __future__ import annotations

import random

# NOTE: no skip: the test extra installs mooncake-transfer-engine-non-cuda and scripts/setup.sh its
# libibverbs1; an import error here is a set-up failure to see.
import mooncake.engine  # noqa: E402, F401
import pytest
import torch
import zmq

from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver  # noqa: E402
from kvbaton.kv.connectors.mooncake import LayerReady, Offer, ToReceiver  # noqa: E402
from kvbaton.kv.connectors.mooncake.engine import PROTOCOL_ENV  # noqa: E402
from kvbaton.kv.layout import KVLayout  # noqa: E402
from kvbaton.kv.pools import KVPools  # noqa: E402
from kvbaton.kv.rows import contiguous_runs  # noqa: E402
from kvbaton.wire import SignedCodec  # noqa: E402
from tests.kv import kv_receiver_peer as peer
from tests.kv.transports import SECRET


def mooncake_pair(make_pair):
    """(sender, receiver, src pools, dst pools) of a mooncake pair."""
    pair = make_pair("mooncake")
    return pair.sender, pair.receiver, pair.src, pair.dst


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


def test_a_bad_offer_fails_alone(make_pair):
    """A signed offer naming memory the sender never registered: Mooncake refuses the read; that
    request fails, a good one read in the same poll completes, and both senders hear of it."""
    sender, receiver, src, dst = mooncake_pair(make_pair)
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


def test_refusals(make_pair, monkeypatch):
    """Offers for other destination blocks than the receiver reserved; an unknown protocol. (A layout mismatch:
    the transport contract.)"""
    sender, receiver, src, dst = mooncake_pair(make_pair)
    receiver.expect("moved", [1, 2], 10.0)  # the sender was told other destination blocks
    send_all(sender, "moved", [1, 2], [2, 3], receiver.address)
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("moved") and r.ended("moved"))
    assert "destination blocks differ" in r.failed["moved"] and "destination blocks differ" in s.failed["moved"]
    assert not any(p.any() for p in dst)
    monkeypatch.setenv(PROTOCOL_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match=PROTOCOL_ENV):
        make_receiver(ConnectorConfig("mooncake", SECRET, allow_insecure_transport=True), KVPools(sender.layout, dst))


def test_contiguous_runs():
    assert contiguous_runs([4, 5, 6, 9, 1], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 1), (1, 4, 1)]
    assert contiguous_runs([], []) == []
