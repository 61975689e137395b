"""An expert worker's exchange socket under hostile frames: a real `ExpertServer` (its thread, its ROUTER bound to
127.0.0.1) over a tiny Qwen3-MoE shard, fed from raw DEALER sockets. Garbage, truncated, bit-flipped, forged,
unknown, multi-part and oversized frames are refused without an answer (and counted); well-signed dispatches it
cannot serve get `ExchangeFailed` naming why; after every batch a valid dispatch still gets its exact rows.
Shared-memory dispatches naming a segment the worker must not map (not an exchange slot, missing, readable by
others, too small) fail the same way; an attention worker's abandoned slots are unlinked, never reused."""

from __future__ import annotations

import errno
import os
import secrets
import socket

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.config import AttentionFFNConfig
from kvbaton.kv.connectors.shm.segments import SHM_DIR, Segment
from kvbaton.parallel.afd import shared_rows
from kvbaton.parallel.afd.client import ExpertPoolClient
from kvbaton.parallel.afd.frames import (
    CombinedRows,
    CombinedShared,
    DispatchRows,
    DispatchShared,
    ExchangeFailed,
    FromExpert,
    LoadQuery,
    PlaceExperts,
    Placing,
    PoolHello,
    PoolLoad,
    PoolWelcome,
    ToExpert,
    max_frame_bytes,
)
from kvbaton.parallel.afd.local_channel import MAX_LOCAL_FRAME_BYTES, connect_local, local_name
from kvbaton.parallel.afd.server import ExpertServer, bytes_of, rows_of
from kvbaton.parallel.afd.shard import ExpertShard, ShardSpec
from kvbaton.parallel.afd.shared_rows import PREFIX, SlotLayout, SlotPool, probe_matches, views
from kvbaton.wire import Codec, SignedCodec
from tests.support.wait import wait_until

SECRET = secrets.token_hex(32).encode()
MAX_ROWS = 64
REPLY_MS = 5000  # a reply that is due comes within this
SILENCE_MS = 150  # a refused frame gets no reply: nothing within this


@pytest.fixture(scope="module")
def server(tiny_moe_models):
    shard = ExpertShard(ShardSpec(tiny_moe_models["qwen3_moe"], rank=0, size=2))
    server = ExpertServer(shard, SECRET, max_rows=MAX_ROWS)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def dealer(ctx, server):
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.address)
    yield socket
    socket.close(linger=0)


def codecs(server: ExpertServer, secret: bytes = SECRET) -> tuple[SignedCodec, SignedCodec]:
    limit = max_frame_bytes(MAX_ROWS, server.shard.hidden, server.shard.dtype_name)
    return SignedCodec(secret, ToExpert, limit), SignedCodec(secret, FromExpert, limit)


def dispatch(server: ExpertServer, n: int = 5, ticket: int = 1, seed: int = 0) -> tuple[DispatchRows, torch.Tensor]:
    """A valid dispatch of n rows to the worker's slots, and the rows its experts must answer."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, server.shard.hidden, generator=gen)
    slots = torch.randint(0, server.shard.slots_per_worker, (n,), generator=gen)
    layer = min(server.shard.moe_layers)
    return (DispatchRows(ticket, layer, 0, bytes_of(rows), bytes_of(slots.to(torch.int32))),
            server.shard.compute(layer, rows, slots))


def reply(socket: zmq.Socket, server: ExpertServer, timeout_ms: int = REPLY_MS):
    if not socket.poll(timeout_ms):
        return None
    return codecs(server)[1].decode(socket.recv())


def assert_still_serves(socket: zmq.Socket, server: ExpertServer, ticket: int = 99) -> None:
    msg, expected = dispatch(server, ticket=ticket, seed=ticket)
    socket.send(codecs(server)[0].encode(msg))
    got = reply(socket, server)
    assert isinstance(got, CombinedRows) and got.ticket == ticket
    assert torch.equal(rows_of(got.rows, torch.float32, server.shard.hidden), expected)


def test_a_valid_hello_and_dispatch_are_answered(dealer, server):
    request, _ = codecs(server)
    dealer.send(request.encode(PoolHello("a", server.shard.hidden, "float32", server.shard.num_experts)))
    welcome = reply(dealer, server)
    assert isinstance(welcome, PoolWelcome) and welcome.epoch == 0
    assert welcome.placement == [list(server.shard.map.physical_to_logical)] * len(server.shard.moe_layers)
    assert_still_serves(dealer, server)


def test_unsigned_forged_and_damaged_frames_get_no_answer(dealer, server):
    request, _ = codecs(server)
    forger, _ = codecs(server, secrets.token_hex(32).encode())
    msg, _ = dispatch(server)
    good = request.encode(msg)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    before = server.stats.refused_frames
    hostile = [b"", b"garbage", good[:31], good[:-1], bytes(flipped), forger.encode(msg),
               request.sign(b"\xc1") + b"\xc1",  # signed, but not msgpack
               request.sign(b"\x81\xa4type\xa4nope") + b"\x81\xa4type\xa4nope"]  # signed, an unknown message
    for frame in hostile:
        dealer.send(frame)
    dealer.send_multipart([good, good])  # a frame in two parts: not one of ours
    assert reply(dealer, server, SILENCE_MS) is None
    assert_still_serves(dealer, server)  # one connection's frames are served in order: every one before is counted
    assert server.stats.refused_frames - before == len(hostile) + 1


@pytest.mark.parametrize("damage", ["layer", "slot", "negative slot", "row bytes", "slot bytes", "too many rows",
                                    "epoch"])
def test_signed_dispatches_it_cannot_serve_fail_that_exchange_only(dealer, server, damage):
    request, _ = codecs(server)
    msg, _ = dispatch(server, ticket=7)
    hidden_bytes = server.shard.hidden * 4
    bad = {"layer": DispatchRows(7, max(server.shard.moe_layers) + 100, 0, msg.rows, msg.slots),
           "slot": DispatchRows(7, msg.layer, 0, msg.rows, bytes_of(torch.full((5,), 999, dtype=torch.int32))),
           "negative slot": DispatchRows(7, msg.layer, 0, msg.rows, bytes_of(torch.full((5,), -1, dtype=torch.int32))),
           "row bytes": DispatchRows(7, msg.layer, 0, msg.rows[:-1], msg.slots),
           "slot bytes": DispatchRows(7, msg.layer, 0, msg.rows, msg.slots[:-2]),
           "too many rows": DispatchRows(7, msg.layer, 0, b"\0" * hidden_bytes * (MAX_ROWS + 1),
                                         b"\0" * 4 * (MAX_ROWS + 1)),
           "epoch": DispatchRows(7, msg.layer, 5, msg.rows, msg.slots)}[damage]
    frame = request.encode(bad)
    if len(frame) > request.max_frame_bytes:  # past the socket's limit: ZeroMQ drops the connection, not the server
        dealer.send(frame)
        assert reply(dealer, server, SILENCE_MS) is None
        return
    dealer.send(frame)
    got = reply(dealer, server)
    assert isinstance(got, ExchangeFailed) and got.ticket == 7 and got.message
    assert_still_serves(dealer, server)


def test_a_new_placement_loads_while_the_old_one_serves_and_bad_ones_are_refused(ctx, tiny_moe_models):
    """EPLB's frames to an expert worker (a server of its own: it changes placement). Malformed placements are
    refused with the reason, nothing loaded; a valid one (the two workers' experts swapped) loads on the side
    while epoch 0 serves; then a dispatch at epoch 1 goes through the experts it moved in."""
    model = tiny_moe_models["qwen3_moe"]
    # a short retention (default 10 s), still far longer than the exchanges below take to show epoch 0 is kept
    own = ExpertServer(ExpertShard(ShardSpec(model, rank=0, size=2, retain_s=2.0)), SECRET, max_rows=MAX_ROWS)
    other = ExpertShard(ShardSpec(model, rank=1, size=2))  # what rank 0 holds once the two swap
    own.start()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(own.address)
    try:
        request, _ = codecs(own)
        layers, per = len(own.shard.moe_layers), own.shard.slots_per_worker
        swapped = [list(range(per, 2 * per)) + list(range(per))] * layers
        bad = {"layers": swapped[:-1], "slots": [row[:-1] for row in swapped],
               "expert out of range": [[99] + row[1:] for row in swapped],
               "expert missing": [[row[1]] + row[1:] for row in swapped]}
        for why, placement in bad.items():
            sock.send(request.encode(PlaceExperts(1, placement)))
            got = reply(sock, own)
            assert isinstance(got, Placing) and got.refused and got.ready == 0, why
        sock.send(request.encode(PlaceExperts(1, swapped)))
        got = reply(sock, own)
        assert isinstance(got, Placing) and not got.refused
        assert_still_serves(sock, own)  # at epoch 0, while epoch 1 loads

        def ready() -> int:
            sock.send(request.encode(LoadQuery()))
            load = reply(sock, own)
            assert isinstance(load, PoolLoad) and len(load.counts) == layers
            return load.ready

        wait_until(lambda: ready() == 1, 30.0, interval_s=0.01, message="placement epoch 1 never loaded")
        sock.send(request.encode(PlaceExperts(1, swapped)))  # again (a replacement's catch-up): held, nothing to do
        got = reply(sock, own)
        assert isinstance(got, Placing) and not got.refused and got.ready == 1
        msg, _ = dispatch(own, ticket=5)
        rows, slots = rows_of(msg.rows, torch.float32, own.shard.hidden), rows_of(msg.slots, torch.int32, 1)
        sock.send(request.encode(DispatchRows(5, msg.layer, 1, msg.rows, msg.slots)))
        got = reply(sock, own)
        assert isinstance(got, CombinedRows) and got.ready == 1
        expected = other.compute(msg.layer, rows, slots.flatten().to(torch.int64))
        assert torch.equal(rows_of(got.rows, torch.float32, own.shard.hidden), expected)
        assert_still_serves(sock, own)  # epoch 0 is kept while it is used
        # ... and dropped once unused for its retention time while epoch 1 serves on
        msg = DispatchRows(6, msg.layer, 1, msg.rows, msg.slots)

        def served_at_epoch_1_only() -> bool:
            sock.send(request.encode(msg))
            assert isinstance(reply(sock, own), CombinedRows)
            return set(own.shard.held) == {1}

        wait_until(served_at_epoch_1_only, 30.0, interval_s=0.02, message="epoch 0 was never dropped")
        sock.send(request.encode(DispatchRows(8, msg.layer, 0, msg.rows, msg.slots)))
        got = reply(sock, own)
        assert isinstance(got, ExchangeFailed) and got.ready == 1 and "epoch 0" in got.message
    finally:
        sock.close(linger=0)
        own.close()


def test_an_oversized_frame_drops_only_its_senders_connection(ctx, dealer, server):
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(server.address)
    try:
        attacker.send(b"\0" * (codecs(server)[0].max_frame_bytes + 1))
        assert reply(attacker, server, SILENCE_MS) is None
        assert_still_serves(dealer, server)  # everyone else is served on
    finally:
        attacker.close(linger=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=st.binary(max_size=2048))
def test_random_frames_never_get_an_answer(dealer, server, frame):
    dealer.send(frame)
    assert reply(dealer, server, 20) is None


def test_the_server_serves_after_the_fuzzing(dealer, server):
    assert server.serving
    assert_still_serves(dealer, server, ticket=123)


def shared_dispatch(server: ExpertServer, slots: SlotPool, n: int = 5, ticket: int = 1):
    """A valid shared-memory dispatch of n rows, its slot and the rows its experts must answer."""
    msg, expected = dispatch(server, n, ticket, seed=ticket)
    slot = slots.take(n)
    rows, ids, _ = views(slot.segment, slot.layout, n, torch.float32, server.shard.hidden)
    rows.copy_(rows_of(msg.rows, torch.float32, server.shard.hidden))
    ids.copy_(rows_of(msg.slots, torch.int32, 1).flatten())
    return DispatchShared(ticket, msg.layer, 0, slot.name, slot.layout.capacity, n), slot, expected


def test_a_shared_memory_dispatch_is_answered_in_its_slot(dealer, server):
    request, _ = codecs(server)
    dealer.send(request.encode(PoolHello("a", server.shard.hidden, "float32", server.shard.num_experts)))
    welcome = reply(dealer, server)
    assert probe_matches(welcome.probe, welcome.probe_token)  # the same host and user: shm is shared
    assert not probe_matches(welcome.probe, secrets.token_bytes(16))
    slots = SlotPool(server.shard.hidden * 4)
    msg, slot, expected = shared_dispatch(server, slots, ticket=5)
    dealer.send(request.encode(msg))
    got = reply(dealer, server)
    assert isinstance(got, CombinedShared) and got.ticket == 5
    assert torch.equal(views(slot.segment, slot.layout, 5, torch.float32, server.shard.hidden)[2], expected)
    slot.retire()


@pytest.mark.parametrize("damage", ["not a slot", "missing", "readable by others", "too small", "rows > capacity",
                                    "capacity > max rows", "slot id", "traversal"])
def test_shared_dispatches_it_must_not_map_fail_that_exchange_only(dealer, server, damage):
    request, _ = codecs(server)
    slots = SlotPool(server.shard.hidden * 4)
    msg, slot, _ = shared_dispatch(server, slots, ticket=8)
    made: list[Segment] = []

    def segment(name: str, size: int, mode: int = 0o600) -> str:
        made.append(Segment.create(name, size))
        os.chmod(os.path.join(SHM_DIR, name), mode)
        return name

    layout = SlotLayout(msg.capacity, server.shard.hidden * 4)
    base = f"{PREFIX}rows-test-{os.getpid()}-{damage.replace(' ', '-')}"
    bad = {"not a slot": lambda: segment(f"kvb-test-{os.getpid()}", layout.size),
           "missing": lambda: f"{PREFIX}rows-nobody-{secrets.token_hex(4)}",
           "readable by others": lambda: segment(base, layout.size, 0o644),
           "too small": lambda: segment(base, layout.size - 1),
           "traversal": lambda: f"{PREFIX}rows-../../{SHM_DIR}/{slot.name}"}
    if damage in bad:
        msg = DispatchShared(8, msg.layer, 0, bad[damage](), msg.capacity, msg.rows)
    elif damage == "rows > capacity":
        msg = DispatchShared(8, msg.layer, 0, msg.segment, msg.capacity, msg.capacity + 1)
    elif damage == "capacity > max rows":
        msg = DispatchShared(8, msg.layer, 0, msg.segment, MAX_ROWS + 64, msg.rows)
    else:
        views(slot.segment, slot.layout, msg.rows, torch.float32, server.shard.hidden)[1][0] = 999
    try:
        dealer.send(request.encode(msg))
        got = reply(dealer, server)
        assert isinstance(got, ExchangeFailed) and got.ticket == 8 and got.message
        assert_still_serves(dealer, server)
    finally:
        slot.retire()
        for made_segment in made:
            made_segment.unlink()


def _no_space(name: str, size: int) -> Segment:
    raise OSError(errno.ENOSPC, f"cannot reserve {size} bytes in {SHM_DIR}")


def test_abandoned_slots_are_unlinked_and_the_pool_serves_on(tiny_moe_models, monkeypatch):
    shard = ExpertShard(ShardSpec(tiny_moe_models["qwen3_moe"], rank=0, size=1))
    server = ExpertServer(shard, SECRET, max_rows=MAX_ROWS)
    server.start()
    config = AttentionFFNConfig(experts=(server.address,), timeout_s=10)
    client = ExpertPoolClient(config, SECRET, "test", shard.hidden, torch.float32, shard.num_experts,
                              list(shard.moe_layers))
    try:
        assert client.shared_memory == client.local_channels == [True]
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(4, shard.hidden, generator=gen)
        ids = torch.randint(0, shard.num_experts, (4, 2), generator=gen)
        weights = torch.rand(4, 2, generator=gen)
        layer = min(shard.moe_layers)
        first = client.wait(client.post(layer, x, ids, weights))
        client.post(layer, x, ids, weights)  # its step fails before the wait
        in_flight = [slot.name for slot in client._in_slot.values()]
        assert in_flight
        client.abandon()
        assert not any(os.path.exists(os.path.join(SHM_DIR, name)) for name in in_flight)
        assert torch.equal(client.wait(client.post(layer, x, ids, weights)), first)
        assert server.stats.shared == server.stats.exchanges == 3
        # /dev/shm full (a container's 64 MiB): an exchange needing a new slot sends its rows in the frame
        with monkeypatch.context() as patch:
            patch.setattr(shared_rows.Segment, "create", _no_space)
            in_slot = client.post(layer, x, ids, weights)  # the free slot
            in_frame = client.post(layer, x, ids, weights)  # no second slot to be had
            assert torch.equal(client.wait(in_slot), first) and torch.equal(client.wait(in_frame), first)
        assert (server.stats.shared, server.stats.exchanges) == (4, 5)
    finally:
        client.close()
        server.close()
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(f"{PREFIX}rows-{os.getpid()}-")]


@pytest.fixture
def local(server):
    """A same-host connection to the server's Unix socket (as an attention worker's)."""
    sock = connect_local(local_name(server.address), 5.0)
    assert sock is not None
    yield sock
    sock.close()


def local_reply(sock: socket.socket, timeout_s: float = REPLY_MS / 1000):
    sock.settimeout(timeout_s)
    try:
        frame = sock.recv(MAX_LOCAL_FRAME_BYTES + 1)
    except TimeoutError:
        return None
    return Codec(FromExpert, MAX_LOCAL_FRAME_BYTES).decode(frame) if frame else b""


def test_the_same_host_socket_serves_shared_dispatches_only(local, dealer, server):
    plain = Codec(ToExpert, MAX_LOCAL_FRAME_BYTES)
    msg, slot, expected = shared_dispatch(server, SlotPool(server.shard.hidden * 4), ticket=21)
    try:
        local.send(plain.encode(msg))
        got = local_reply(local)
        assert isinstance(got, CombinedShared) and got.ticket == 21
        assert torch.equal(views(slot.segment, slot.layout, 5, torch.float32, server.shard.hidden)[2], expected)
        before = server.stats.refused_frames
        rows_msg, _ = dispatch(server, n=1)
        hostile = [b"garbage", b"\xc1", plain.encode(PoolHello("a", 1, "float32", 1)), plain.encode(rows_msg),
                   b"\0" * (MAX_LOCAL_FRAME_BYTES + 100), codecs(server)[0].encode(msg)]  # signed: not here
        for frame in hostile:
            local.send(frame)
        local.send(plain.encode(msg))  # served after all of them, on the same connection
        got = local_reply(local)
        assert isinstance(got, CombinedShared) and got.ticket == 21
        assert server.stats.refused_frames - before == len(hostile)
    finally:
        slot.retire()
    assert_still_serves(dealer, server)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=st.binary(min_size=1, max_size=2048))
def test_random_same_host_frames_never_get_an_answer(local, server, frame):
    local.send(frame)
    assert local_reply(local, 0.02) is None
