"""What only the redis KV transport has, against a real, private redis-server (started here, stopped by PID):
keys under a TTL, deleted once read; data tampered with in the store; notices that name keys or other blocks; an
abort racing the receiver; the private server itself; a dead store. The contract every transport keeps is
tests/kv/test_transport_contract.py; pairs come from the `make_pair` fixture (tests/kv/transports.py)."""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import socket

import msgspec
import pytest
import redis
import torch

from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver, make_sender
from kvbaton.kv.connectors.redis import KEY_PREFIX, LayerStored, Notice, dst_digest
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools
from kvbaton.kv.redis_server import redis_server_binary, start_redis_server
from kvbaton.wire import SignedCodec
from tests.kv import kv_receiver_peer as peer
from tests.kv.transports import REDIS_TTL_S as TTL_S
from tests.kv.transports import SECRET

# NOTE: no skip: scripts/setup.sh installs redis-server, so its absence is a set-up failure to see.
assert redis_server_binary() is not None, "redis-server is not installed (scripts/setup.sh installs it with apt-get)"



def blocks(seed: int, n: int = 6) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(peer.BLOCKS), n), rng.sample(range(peer.BLOCKS), n)


def spec(request_id: str, src: list[int], dst: list[int], receiver: str, layout: KVLayout,
         deadline_s: float = 10.0) -> TransferSpec:
    return TransferSpec(request_id=request_id, src_block_ids=src, dst_block_ids=dst, receiver=receiver,
                        layout=layout, deadline_s=deadline_s)


def unpark(store: redis.Redis, parked: str, address: str) -> None:
    """Move every parked notice to the receiver's list in one transaction, the way a sender's pipeline delivers
    them: a receiver blocked in BLPOP is served after it, so it never sees the list half moved."""
    with store.pipeline(transaction=True) as pipe:
        for _ in range(store.llen(parked)):
            pipe.lmove(parked, address)
        pipe.execute()


def data_keys(store: redis.Redis, request_id: str) -> list[bytes]:
    return sorted(store.scan_iter(match=f"{KEY_PREFIX}{request_id}:*"))


def redis_pair(make_pair):
    """(sender, receiver, src pools, dst pools) of a redis pair over the module's redis-server."""
    pair = make_pair("redis")
    return pair.sender, pair.receiver, pair.src, pair.dst


def test_keys_carry_a_ttl_and_are_deleted_after_reading(make_pair, store):
    sender, receiver, src, dst = redis_pair(make_pair)
    parked = f"kvbaton:kvq:parked:{secrets.token_hex(4)}"  # notifications wait here until we move them
    src_ids, dst_ids = blocks(3)
    receiver.expect("b", dst_ids, 10.0)
    sender.begin(spec("b", src_ids, dst_ids, parked, sender.layout))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, ["b"])
    peer.poll_until([sender], lambda s: s.completed == {"b"})

    keys = data_keys(store, "b")
    assert len(keys) == peer.LAYERS
    assert all(0 < store.ttl(k) <= TTL_S for k in keys)
    assert 0 < store.ttl(parked) <= TTL_S and store.llen(parked) == peer.LAYERS

    unpark(store, parked, receiver.address)
    (r,) = peer.poll_until([receiver], lambda r: r.ended("b"))
    assert r.completed == {"b"}
    assert store.exists(*keys) == 0 and data_keys(store, "b") == []
    assert store.exists(receiver.address) == 0  # the notification list is drained too


def test_tampered_data_is_refused_and_the_receiver_keeps_working(make_pair, store):
    sender, receiver, src, dst = redis_pair(make_pair)
    parked = f"kvbaton:kvq:parked:{secrets.token_hex(4)}"
    src_ids, dst_ids = blocks(4)
    receiver.expect("c", dst_ids, 10.0)
    sender.begin(spec("c", src_ids, dst_ids, parked, sender.layout))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, ["c"])
    peer.poll_until([sender], lambda s: s.completed == {"c"})
    victim = data_keys(store, "c")[1]
    store.setrange(victim, 5, b"\x7f\x7f\x7f")  # same length, different bytes
    unpark(store, parked, receiver.address)
    (r,) = peer.poll_until([receiver], lambda r: r.ended("c"))
    assert "SHA-256" in r.failed["c"]

    _transfer_completes(sender, receiver, "c2", src, dst, seed=5)


def test_unauthenticated_notices_touch_no_key_and_misdirected_ones_are_dropped(make_pair, store):
    """Notices naming keys that hold data: unsigned or another cluster's touch no key; a signed one for other
    destination blocks is dropped. (Junk and forged notices in general: the transport contract.)"""
    sender, receiver, src, dst = redis_pair(make_pair)
    src_ids, dst_ids = blocks(6)
    receiver.expect("d", dst_ids, 10.0)
    payload = torch.zeros(len(dst_ids), sender.layout.block_numel, dtype=torch.bfloat16).view(torch.uint8).numpy()
    keys = [f"{KEY_PREFIX}d:forged:{layer}" for layer in range(peer.LAYERS)]
    for key in keys:
        store.set(key, payload.tobytes(), ex=TTL_S)

    def notice(layer: int, blocks: list[int]) -> LayerStored:
        return LayerStored("d", "forged", dst_digest(blocks), layer, peer.LAYERS, keys[layer], payload.nbytes,
                           hashlib.sha256(payload).digest(), sender.layout.dtype)

    unsigned = msgspec.msgpack.encode(notice(0, dst_ids))
    frames = [unsigned, SignedCodec(b"not-the-cluster-secret", Notice).encode(notice(1, dst_ids)),
              # signed, but for other destination blocks (a stale attempt): dropped, "d" unharmed
              SignedCodec(SECRET, Notice).encode(notice(2, dst_ids[::-1]))]
    store.rpush(receiver.address, *frames)
    (r,) = peer.poll_for([receiver], 0.5)
    assert not r.completed and not r.failed  # refused and logged; "d" is still expected
    assert store.exists(*keys[:2]) == 2  # an unauthenticated notice makes the receiver touch nothing
    assert not any(p.any() for p in dst)

    sender.begin(spec("d", src_ids, dst_ids, receiver.address, sender.layout))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, ["d"])
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("d") and r.ended("d"))
    assert r.completed == {"d"} and s.completed == {"d"}
    for got, want in zip(peer.rows(dst, dst_ids), peer.rows(src, src_ids)):
        assert torch.equal(got, want)


def test_a_layer_deleted_by_an_abort_reports_the_abort_not_expiry(make_pair, store):
    """The race a clean-clone CI run hit: the receiver takes a layer's notice, the sender aborts and deletes the
    layer, the receiver finds it gone. Parking the notices replays that order every time."""
    sender, receiver, src, dst = redis_pair(make_pair)
    parked = f"kvbaton:kvq:parked:{secrets.token_hex(4)}"
    src_ids, dst_ids = blocks(9)
    for request_id in ("expired", "aborted"):
        receiver.expect(request_id, dst_ids, 10.0)
        sender.begin(spec(request_id, src_ids, dst_ids, parked, sender.layout))
        sender.save_layer(0, [request_id])
        peer.poll_until([sender], lambda s: store.llen(parked) == 1)
        if request_id == "expired":
            store.delete(*data_keys(store, request_id))  # as redis' TTL would
        else:
            sender.abort(request_id)
            peer.poll_until([sender], lambda s, rid=request_id: store.llen(parked) == 2 and not data_keys(store, rid))
        unpark(store, parked, receiver.address)
        (r,) = peer.poll_until([receiver], lambda r, rid=request_id: r.ended(rid))
        reason = r.failed[request_id]
        assert ("gave up: aborted by the prefill worker" in reason) == (request_id == "aborted"), reason
        assert ("is gone from redis" in reason) == (request_id == "expired"), reason
    assert not any(p.any() for p in dst)


def test_a_missing_url_is_refused(make_pair):
    sender = redis_pair(make_pair)[0]
    with pytest.raises(ValueError, match="redis_url"):
        make_sender(ConnectorConfig("redis", SECRET), sender.pools)


def test_private_server_needs_its_password_and_stops_by_pid():
    srv = start_redis_server()
    try:
        client = redis.Redis.from_url(srv.url)
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
        client.close()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5.0) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(100).startswith(b"-NOAUTH")
    finally:
        srv.stop()
    assert not os.path.exists(f"/proc/{srv.pid}")


def _transfer_completes(sender, receiver, request_id, src, dst, seed):
    src_ids, dst_ids = blocks(seed)
    receiver.expect(request_id, dst_ids, 10.0)
    sender.begin(spec(request_id, src_ids, dst_ids, receiver.address, sender.layout))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, [request_id])
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended(request_id) and r.ended(request_id))
    assert s.completed == {request_id} and r.completed == {request_id}
    for got, want in zip(peer.rows(dst, dst_ids), peer.rows(src, src_ids)):
        assert torch.equal(got, want)


def test_a_dead_store_fails_transfers_with_a_reason():
    srv = start_redis_server()
    config = ConnectorConfig("redis", SECRET, redis_url=srv.url, redis_ttl_s=TTL_S, worker_name="t")
    src, dst = peer.pools(torch.float32, seed=1), peer.pools(torch.float32)
    layout = peer.kv_layout(torch.float32)
    sender, receiver = make_sender(config, KVPools(layout, src)), make_receiver(config, KVPools(layout, dst))
    try:
        srv.stop()
        src_ids, dst_ids = blocks(9)
        receiver.expect("g", dst_ids, 1.0)
        sender.begin(spec("g", src_ids, dst_ids, receiver.address, layout, deadline_s=1.0))
        for layer in range(peer.LAYERS):
            sender.save_layer(layer, ["g"])
        s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("g") and r.ended("g"), timeout_s=20.0)
    finally:
        sender.close()
        receiver.close()
    assert "ConnectionError" in s.failed["g"] or "deadline" in s.failed["g"]
    assert "redis:" in r.failed["g"] and not any(p.any() for p in dst)
