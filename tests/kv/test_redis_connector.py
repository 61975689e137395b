"""The redis KV transport against a real, private redis-server (started here, stopped by PID)."""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import socket
import time

import kv_receiver_peer as peer
import msgspec
import pytest
import redis
import torch

from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver, make_sender
from kvbaton.kv.connectors.redis import KEY_PREFIX, LayerStored, Notice, dst_digest
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from kvbaton.kv.pools import KVPools
from kvbaton.kv.redis_server import redis_server_binary, start_redis_server
from kvbaton.wire import SECRET_ENV, SignedCodec

# NOTE: no skip: scripts/setup.sh installs redis-server, so its absence is a set-up failure to see.
assert redis_server_binary() is not None, "redis-server is not installed (scripts/setup.sh installs it with apt-get)"

SECRET = secrets.token_hex(16).encode()
TTL_S = 30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture
def connectors(server):
    """make(dtype) -> (sender, receiver, src pools, dst pools); everything is closed after the test."""
    made = []

    def make(dtype: torch.dtype = torch.bfloat16, secret: bytes = SECRET):
        config = ConnectorConfig("redis", secret, redis_url=server.url, redis_ttl_s=TTL_S, worker_name="t")
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


def data_keys(store: redis.Redis, request_id: str) -> list[bytes]:
    return sorted(store.scan_iter(match=f"{KEY_PREFIX}{request_id}:*"))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_land_only_after_the_last_layer_and_only_in_poll(connectors, dtype):
    sender, receiver, src, dst = connectors(dtype)
    src_ids, dst_ids = blocks(1)
    receiver.expect("a", dst_ids, 10.0)
    sender.begin(spec("a", src_ids, dst_ids, receiver.address, sender.layout))
    for layer in range(peer.LAYERS - 1):
        sender.save_layer(layer, ["a"])
    s, r = peer.poll_for([sender, receiver], 0.5)
    assert not (s.completed or s.failed or r.completed or r.failed)

    sender.save_layer(peer.LAYERS - 1, ["a"])
    (s,) = peer.poll_until([sender], lambda s: s.ended("a"))
    assert s.completed == {"a"}  # every layer is in the store: the prefill blocks may go
    time.sleep(0.3)  # the reader thread has the last layer by now, but only poll() may write the pool
    assert not dst[-1].any()

    (r,) = peer.poll_until([receiver], lambda r: r.ended("a"))
    assert r.completed == {"a"} and not r.failed
    for got, want in zip(peer.rows(dst, dst_ids), peer.rows(src, src_ids)):
        assert torch.equal(got, want)
    assert peer.others_zero(dst, dst_ids)


def test_sender_and_receiver_in_different_processes(server):
    src_ids, dst_ids = blocks(2, n=10)
    proc = peer.spawn("redis", list(DTYPES), dst_ids, {SECRET_ENV: SECRET.decode(), peer.REDIS_URL_ENV: server.url})
    config = ConnectorConfig("redis", SECRET, redis_url=server.url, redis_ttl_s=TTL_S)
    srcs = {name: peer.pools(dtype, seed=7) for name, dtype in DTYPES.items()}
    senders = {name: make_sender(config, KVPools(peer.kv_layout(DTYPES[name]), src)) for name, src in srcs.items()}
    try:
        ready = peer.read_event(proc, 30.0)
        for name, sender in senders.items():
            sender.begin(spec(f"x-{name}", src_ids, dst_ids, ready["addresses"][name], sender.layout))
            for layer in range(peer.LAYERS):
                sender.save_layer(layer, [f"x-{name}"])
        outcomes = peer.poll_until(list(senders.values()), lambda *o: all(x.completed or x.failed for x in o))
        done = peer.read_event(proc, 15.0)
    finally:
        for sender in senders.values():
            sender.close()
        proc.kill()
        proc.wait(5)
    for name, outcome in zip(senders, outcomes):
        assert outcome.completed == {f"x-{name}"}
        assert done[name]["completed"] == [f"x-{name}"] and done[name]["others_zero"]
        assert done[name]["digests"] == peer.digests(srcs[name], src_ids)


def test_keys_carry_a_ttl_and_are_deleted_after_reading(connectors, store):
    sender, receiver, src, dst = connectors()
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

    while store.lmove(parked, receiver.address):
        pass
    (r,) = peer.poll_until([receiver], lambda r: r.ended("b"))
    assert r.completed == {"b"}
    assert store.exists(*keys) == 0 and data_keys(store, "b") == []
    assert store.exists(receiver.address) == 0  # the notification list is drained too


def test_tampered_data_is_refused_and_the_receiver_keeps_working(connectors, store):
    sender, receiver, src, dst = connectors()
    parked = f"kvbaton:kvq:parked:{secrets.token_hex(4)}"
    src_ids, dst_ids = blocks(4)
    receiver.expect("c", dst_ids, 10.0)
    sender.begin(spec("c", src_ids, dst_ids, parked, sender.layout))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, ["c"])
    peer.poll_until([sender], lambda s: s.completed == {"c"})
    victim = data_keys(store, "c")[1]
    store.setrange(victim, 5, b"\x7f\x7f\x7f")  # same length, different bytes
    while store.lmove(parked, receiver.address):
        pass
    (r,) = peer.poll_until([receiver], lambda r: r.ended("c"))
    assert "SHA-256" in r.failed["c"]

    _transfer_completes(sender, receiver, "c2", src, dst, seed=5)


def test_forged_unsigned_and_misdirected_notices_are_refused(connectors, store):
    sender, receiver, src, dst = connectors()
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
    frames = [b"", b"junk", unsigned, b"\0" * 32 + unsigned,
              SignedCodec(b"not-the-cluster-secret", Notice).encode(notice(1, dst_ids)),
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


def test_deadlines_fail_both_sides(connectors):
    sender, receiver, src, dst = connectors()
    src_ids, dst_ids = blocks(7)
    receiver.expect("lonely", dst_ids, 0.3)  # nothing will ever come
    receiver.expect("slow", dst_ids, 10.0)
    sender.begin(spec("slow", src_ids, dst_ids, receiver.address, sender.layout, deadline_s=0.3))
    sender.save_layer(0, ["slow"])  # and never the rest
    started = time.monotonic()
    s, r = peer.poll_until([sender, receiver], lambda s, r: s.ended("slow") and r.ended("slow") and r.ended("lonely"))
    assert time.monotonic() - started < 5.0  # the receiver hears of the sender's deadline, not its own
    assert "deadline" in s.failed["slow"]
    assert "within 0.3 s" in r.failed["lonely"]
    assert "gave up" in r.failed["slow"]
    assert all(not p.any() for p in dst[1:])  # layer 0 may have landed; nothing else did


def test_cancel_and_abort(connectors, store):
    sender, receiver, src, dst = connectors()
    src_ids, dst_ids = blocks(8)
    receiver.expect("cancelled", dst_ids, 10.0)
    receiver.cancel("cancelled")
    sender.begin(spec("cancelled", src_ids, dst_ids, receiver.address, sender.layout))
    for layer in range(peer.LAYERS):
        sender.save_layer(layer, ["cancelled"])
    s, r = peer.poll_for([sender, receiver], 0.6)
    assert s.completed == {"cancelled"}
    assert not r.completed and not r.failed and all(not p.any() for p in dst)  # late data dropped
    assert data_keys(store, "cancelled") == []  # ...and deleted

    receiver.expect("aborted", dst_ids, 10.0)
    sender.begin(spec("aborted", src_ids, dst_ids, receiver.address, sender.layout))
    sender.save_layer(0, ["aborted"])
    sender.abort("aborted")
    s, r = peer.poll_until([sender, receiver], lambda s, r: r.ended("aborted"))
    assert "aborted" in r.failed["aborted"]
    s2 = peer.poll_for([sender], 0.2)[0]
    assert not (s.completed or s.failed or s2.completed or s2.failed)  # abort() is not reported
    assert data_keys(store, "aborted") == []


def test_a_layer_deleted_by_an_abort_reports_the_abort_not_expiry(connectors, store):
    """The race a clean-clone CI run hit: the receiver takes a layer's notice, the sender aborts and deletes the
    layer, the receiver finds it gone. Parking the notices replays that order every time."""
    sender, receiver, src, dst = connectors()
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
        while store.lmove(parked, receiver.address):
            pass
        (r,) = peer.poll_until([receiver], lambda r, rid=request_id: r.ended(rid))
        reason = r.failed[request_id]
        assert ("gave up: aborted by the prefill worker" in reason) == (request_id == "aborted"), reason
        assert ("is gone from redis" in reason) == (request_id == "expired"), reason
    assert not any(p.any() for p in dst)


def test_layout_mismatch_and_missing_url(connectors, server):
    sender, receiver, src, dst = connectors()
    other = KVLayout.standard(num_layers=peer.LAYERS, block_size=peer.BLOCK * 2, num_kv_heads=peer.HEADS,
                              head_dim=peer.DIM, dtype="bfloat16")
    with pytest.raises(KVLayoutMismatch, match="block_size"):
        sender.begin(spec("e", [0], [0], receiver.address, other))
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
