"""The KV transport contract (`kvbaton/kv/connectors/base.py`), checked on every transport the same way, with real
sockets, shared memory, a real redis-server and real Mooncake Transfer Engines, all on 127.0.0.1.

Each behaviour is one test parametrized over `VARIANTS` (tcp, shm, shm-shared, redis, mooncake; pairs from the
`make_pair` fixture, tests/kv/transports.py). Where transports genuinely differ (the words of a failure, whether a
side is told at all, when a sender is done) the difference is a table below, keyed by transport, never a copy of a
test: adding a transport is one entry in `VARIANTS` and one in each table. What only one transport has stays in its
own file (test_connectors.py: tcp and shm; test_redis_connector.py; test_mooncake_connector.py).

Waits are bounded; every process a test starts is stopped by it; the redis-server is the module's (each test uses
request ids and keys of its own).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvbaton.kv.connectors import TRANSPORTS, KVSender, TransferSpec
from kvbaton.kv.connectors.zmq_control import NOT_EXPECTING
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from tests.kv import kv_receiver_peer as receiver_peer
from tests.kv.kv_peer import BLOCK, BLOCKS, DIM, HEADS, LAYERS, seeded_pools
from tests.kv.transports import (
    DTYPES,
    VARIANTS,
    SenderPeer,
    my_segments,
    pump,
    random_ids,
    rows,
    sender_peer_args,
    transport_of,
    watch,
)
from tests.support.wait import wait_until

# ---- where the transports differ ---------------------------------------------------------------------------------

# When a sender reports a transfer completed: once its receiver confirmed every layer, or (redis) once the store
# holds every layer: the prefill worker's blocks may go before the decode worker has read any of it.
SENDER_DONE = {"tcp": "confirmed", "shm": "confirmed", "mooncake": "confirmed", "redis": "stored"}

# A receiver's failure at its own deadline `s`, with `n` of the layers in.
RECEIVER_DEADLINE = {
    "tcp": "not every layer arrived within {s:g}s ({n}/4 layers)",
    "shm": "not every layer arrived within {s:g}s ({n}/4 layers)",
    "redis": "no complete KV within {s:.1f} s ({n}/4 layers arrived)",
    "mooncake": "no complete KV within {s:.1f} s ({n}/4 layers read)",
}

# A sender's failure at its own deadline `s` (its count of layers sent, where it gives one, left out: how many
# crossed by then is the machine's business).
SENDER_DEADLINE = {
    "tcp": "no confirmation from the decode worker within {s:g}s",
    "shm": "no confirmation from the decode worker within {s:g}s",
    "redis": "deadline of {s:.1f} s passed",
    "mooncake": "receiver did not confirm within {s:.1f} s",
}

# What a receiver reports when its sender gave up at the sender's deadline `s`.
SENDER_GAVE_UP = {
    "tcp": "prefill worker: no confirmation from the decode worker within {s:g}s",
    "shm": "prefill worker: no confirmation from the decode worker within {s:g}s",
    "redis": "the prefill side gave up: deadline passed on the prefill side",
    "mooncake": "sender cancelled: receiver did not confirm within {s:.1f} s",
}

# What a sender reports when its receiver gave up at the receiver's deadline: these words, then the receiver's
# reason. None: it is not told (a redis receiver never talks to its sender: the sender ends when the store holds
# every layer, or at its own deadline).
RECEIVER_GAVE_UP = {"tcp": "decode worker: ", "shm": "decode worker: ", "mooncake": "receiver: ", "redis": None}

# A sender's failure at its deadline `s` when nothing ever answered at its receiver's address, every layer sent.
# None: it completes (redis: done once the store holds every layer; they expire after redis_ttl_s).
NEVER_ANSWERED = {
    "tcp": "no confirmation from the decode worker within {s:g}s (4/4 layers sent)",
    "shm": "no confirmation from the decode worker within {s:g}s (4/4 layers sent)",
    "mooncake": "receiver did not confirm within {s:.1f} s",
    "redis": None,
}

# A sender's outcome when its receiver cancelled the request (before any data, midway): ("failed", words of its
# reason); ("completed", None): done once the store holds every layer (redis); or None: not told, the transfer ends
# at the sender's deadline (a mooncake receiver answers only an offer for a request it no longer expects).
CANCELLED = {
    "tcp": (("failed", NOT_EXPECTING), ("failed", "cancelled by the decode worker")),
    "shm": (("failed", NOT_EXPECTING), ("failed", "cancelled by the decode worker")),
    "mooncake": (("failed", "the decode worker is not expecting this request (cancelled"), None),
    "redis": (("completed", None), ("completed", None)),
}

# How many refusals a receiver logs for raw messages (each a list of frames) that it refuses.
REFUSALS_LOGGED = {
    "tcp": len,  # one per message
    "shm": len,
    "mooncake": lambda messages: sum(len(m) == 1 for m in messages),  # its ROUTER drops other shapes unlogged
    "redis": lambda messages: sum(map(len, messages)),  # a list holds single frames: every part is one
}

# Whether a receiver hears of a transfer its sender refused at begin() for a layout mismatch (the tcp and shm
# senders tell it; the others refuse before anything is sent: the receiver's request ends at its deadline).
REFUSED_BEGIN_TOLD = {"tcp": True, "shm": True, "redis": False, "mooncake": False}


def misstated_layout(transport: str, block_bytes: int, n: int) -> tuple[str, str | None]:
    """(the receiver's words, the sender's) when a spec misstated the receiver's layout, so the sender sent `n`
    blocks of its own `block_bytes`. Sender None: it completes (redis: done once stored; the receiver refuses
    a layer of the wrong size)."""
    return {
        "tcp": ("KV layout mismatch", "KV layout mismatch"),
        "shm": ("KV layout mismatch", "KV layout mismatch"),
        "mooncake": ("KV layout mismatch", "KV layout mismatch"),
        "redis": (f"layer 0 has {n * block_bytes} bytes, {n} blocks expected", None),
    }[transport]


# ---- the contract ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_land_only_in_poll_and_only_after_the_last_layer(make_pair, variant, dtype):
    pair = make_pair(variant, dtype, seed=1)
    rng = random.Random(variant)
    src_a, src_b = random_ids(rng, 7, 5, exclude={20, 21})
    dst_a, dst_b = random_ids(rng, 7, 5, exclude={30, 31})
    src_a[1:1], dst_a[1:1] = [20, 21], [30, 31]  # a run contiguous on both sides (mooncake: one read for two blocks)
    for request_id, src, dst in (("a", src_a, dst_a), ("b", src_b, dst_b)):
        pair.receiver.expect(request_id, dst, 10.0)
        pair.sender.begin(pair.spec(request_id, src, dst))
    saving = ["a", "not-transferring", "b"]
    for layer in range(LAYERS - 1):
        pair.sender.save_layer(layer, saving)
    rlog, slog = watch(pair.sender, pair.receiver, 0.4)
    assert not (rlog.completed or rlog.failed or slog.completed or slog.failed)  # nothing ends before the last layer
    assert not pair.dst[-1].any()

    pair.sender.save_layer(LAYERS - 1, saving)
    if SENDER_DONE[pair.transport] == "stored":
        _, slog = pump(pair.sender, None, lambda r, s: len(s.completed) == 2)  # the prefill blocks may go
        # the receiver's side has taken every layer out of the store (read and deleted: no key left)...
        wait_until(lambda: not pair.medium.leftovers("a", "b"), 10.0, message="the reader did not take the layers")
    else:
        # a window for the receiver's side to act behind poll()'s back: nothing may happen, so no condition to wait for
        _, slog = watch(pair.sender, None, 0.2)
        assert not (slog.completed or slog.failed)  # no confirmation while the receiver is not polled
    assert not pair.dst[-1].any()  # ...but only the receiver's poll() writes its pool

    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: len(r.completed) == 2 and len(s.completed) == 2,
                      logs=(rlog, slog))
    assert sorted(rlog.completed) == sorted(slog.completed) == ["a", "b"] and not rlog.failed and not slog.failed
    untouched = sorted(set(range(BLOCKS)) - set(dst_a) - set(dst_b))
    for layer in range(LAYERS):
        assert torch.equal(rows(pair.dst, layer, dst_a), rows(pair.src, layer, src_a))
        assert torch.equal(rows(pair.dst, layer, dst_b), rows(pair.src, layer, src_b))
        assert not rows(pair.dst, layer, untouched).any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_layer_lands_as_it_arrives(make_pair, variant):
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_sender_and_receiver_in_different_processes(make_pair, variant, tmp_path):
    """Both ways at once: a receiver here for a sender in another process (kv_peer.py, bfloat16), and senders here,
    one per dtype, for receivers in another (kv_receiver_peer.py, one process for both dtypes)."""
    transport, rng = transport_of(variant), random.Random(8)
    receiver = make_pair.receiver(variant)
    src_in, dst_in = random_ids(rng, 12, 12)
    receiver.expect("x", dst_in, 30.0)
    shared = ["--shared"] if variant == "shm-shared" else []
    sender_peer = SenderPeer(tmp_path, make_pair.peer_env(variant),
                             *sender_peer_args(transport, receiver.address, 11, src_in, dst_in, *shared))
    src_out, dst_out = random_ids(rng, 10, 10)
    recv_proc = receiver_peer.spawn(transport, list(DTYPES), dst_out, make_pair.peer_env(variant))
    senders = {name: make_pair.sender(variant, dtype, seed=7) for name, dtype in DTYPES.items()}
    try:
        ready = receiver_peer.read_event(recv_proc, 30.0)
        for name, sender in senders.items():
            sender.begin(spec_to(ready["addresses"][name], f"x-{name}", src_out, dst_out, sender, deadline_s=20.0))
            for layer in range(LAYERS):
                sender.save_layer(layer, [f"x-{name}"])
        pump(None, receiver, lambda r, s: r.completed == ["x"], timeout_s=30.0)
        outcomes = receiver_peer.poll_until(list(senders.values()), lambda *o: all(x.completed or x.failed for x in o),
                                            timeout_s=30.0)
        done = receiver_peer.read_event(recv_proc, 15.0)
        assert sender_peer.event("done")["completed"] == ["x"]
        assert sender_peer.proc.wait(10) == 0
    finally:
        sender_peer.stop()
        recv_proc.kill()
        recv_proc.wait(5)
    expected = seeded_pools(11, torch.bfloat16)
    assert all(torch.equal(rows(receiver.pools.caches, layer, dst_in), rows(expected, layer, src_in))
               for layer in range(LAYERS))
    assert not my_segments(pid=sender_peer.proc.pid)  # the peer unlinked its segments on close
    for (name, sender), outcome in zip(senders.items(), outcomes):
        assert outcome.completed == {f"x-{name}"}  # its receiver confirmed (redis: the store holds it)
        assert done[name]["completed"] == [f"x-{name}"] and done[name]["others_zero"]
        assert done[name]["digests"] == receiver_peer.digests(sender.pools.caches, src_out)


def spec_to(address: str, request_id: str, src: list[int], dst: list[int], sender: KVSender,
            deadline_s: float) -> TransferSpec:
    """A spec for a receiver that is not a pair's (in another process, or none at all): of the sender's layout."""
    return TransferSpec(request_id=request_id, src_block_ids=src, dst_block_ids=dst, receiver=address,
                        layout=sender.layout, deadline_s=deadline_s)


@pytest.mark.parametrize("variant", VARIANTS)
def test_deadlines_fail_both_sides(make_pair, variant):
    pair = make_pair(variant)
    transport = pair.transport
    src_p, src_s, dst_l, dst_p, dst_s = random_ids(random.Random(3), 4, 4, 4, 4, 4)
    pair.receiver.expect("lonely", dst_l, 0.3)  # nothing will ever come
    pair.receiver.expect("partial", dst_p, 0.4)  # the receiver's deadline comes first...
    pair.sender.begin(pair.spec("partial", src_p, dst_p, deadline_s=10.0))
    pair.receiver.expect("slow", dst_s, 10.0)  # ...the sender's here
    pair.sender.begin(pair.spec("slow", src_s, dst_s, deadline_s=0.3))
    pair.sender.save_layer(0, ["partial", "slow"])  # and never the rest
    told = RECEIVER_GAVE_UP[transport]
    rlog, slog = pump(pair.sender, pair.receiver,
                      lambda r, s: {"lonely", "partial", "slow"} <= set(r.failed) and "slow" in s.failed
                      and (told is None or "partial" in s.failed))
    assert RECEIVER_DEADLINE[transport].format(s=0.3, n=0) in rlog.failed["lonely"]
    assert RECEIVER_DEADLINE[transport].format(s=0.4, n=1) in rlog.failed["partial"]
    if told is not None:  # the sender hears of the receiver's deadline, not its own (10 s away)
        assert told + RECEIVER_DEADLINE[transport].format(s=0.4, n=1) in slog.failed["partial"]
    else:
        pair.sender.abort("partial")
    assert SENDER_DEADLINE[transport].format(s=0.3) in slog.failed["slow"]
    # the receiver hears of the sender's deadline, not its own (which would say "within 10")
    assert SENDER_GAVE_UP[transport].format(s=0.3) in rlog.failed["slow"] and "within 10" not in rlog.failed["slow"]
    assert not any(rows(pair.dst, layer, dst_l).any() for layer in range(LAYERS))
    # layer 0 may have landed; nothing else did
    assert not any(rows(pair.dst, layer, dst_p + dst_s).any() for layer in range(1, LAYERS))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_receiver_that_never_answers_fails_the_sender_by_its_deadline(make_pair, variant):
    pair = make_pair(variant)
    with pair.medium.silent_receivers() as addresses:  # nothing listens there, or something that never answers
        request_ids = [f"unheard-{i}" for i in range(len(addresses))]
        for request_id, address in zip(request_ids, addresses):
            pair.sender.begin(spec_to(address, request_id, [1, 2], [3, 4], pair.sender, deadline_s=0.3))
        for layer in range(LAYERS):
            pair.sender.save_layer(layer, request_ids)
        _, slog = pump(pair.sender, None, lambda r, s: all(s.ended(rid) for rid in request_ids))
    expected = NEVER_ANSWERED[pair.transport]
    for request_id in request_ids:
        if expected is None:
            assert request_id in slog.completed
        else:
            assert expected.format(s=0.3) in slog.failed[request_id]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cancel_drops_late_data(make_pair, variant):
    pair = make_pair(variant)
    src_a, src_b, dst_a, dst_b = random_ids(random.Random(4), 5, 5, 5, 5)
    pair.receiver.expect("a", dst_a, 10.0)
    pair.receiver.expect("b", dst_b, 10.0)
    pair.receiver.cancel("b")  # before any data
    pair.sender.begin(pair.spec("a", src_a, dst_a))
    pair.sender.begin(pair.spec("b", src_b, dst_b))
    pair.sender.save_layer(0, ["a", "b"])
    # NOTE: the sender may hear of "b" while layer 0 of "a" is awaited: the logs carry on
    rlog0, slog = pump(pair.sender, pair.receiver,
                       lambda r, s: torch.equal(rows(pair.dst, 0, dst_a), rows(pair.src, 0, src_a)))
    assert not (rlog0.completed or rlog0.failed)
    pair.receiver.cancel("a")  # midway
    for layer in range(1, LAYERS):
        pair.sender.save_layer(layer, ["a", "b"])
    before, midway = CANCELLED[pair.transport]
    expected = {"b": before, "a": midway}
    told = [rid for rid, outcome in expected.items() if outcome is not None]
    rlog, slog = pump(pair.sender, pair.receiver,
                      lambda r, s: all(s.ended(rid) for rid in told) and not pair.medium.leftovers("a", "b"),
                      logs=(rlog0, slog))
    for request_id, outcome in expected.items():
        if outcome is None:  # not told: never confirmed either
            assert request_id not in slog.completed
            pair.sender.abort(request_id)
        elif outcome[0] == "completed":
            assert request_id in slog.completed
        else:
            assert outcome[1] in slog.failed[request_id]
    rlog2, _ = watch(None, pair.receiver, 0.2)
    assert not (rlog.completed or rlog.failed or rlog2.completed or rlog2.failed)  # the receiver reports neither
    assert not any(rows(pair.dst, layer, dst_a).any() for layer in range(1, LAYERS))  # late data dropped
    assert not any(rows(pair.dst, layer, dst_b).any() for layer in range(LAYERS))
    assert not pair.medium.leftovers("a", "b")  # ...and nothing of it left behind


@pytest.mark.parametrize("variant", VARIANTS)
def test_abort_tells_the_receiver(make_pair, variant):
    pair = make_pair(variant)
    src_e, src_m, dst_e, dst_m = random_ids(random.Random(5), 5, 5, 5, 5)
    for request_id, src, dst in (("early", src_e, dst_e), ("midway", src_m, dst_m)):
        pair.receiver.expect(request_id, dst, 10.0)
        pair.sender.begin(pair.spec(request_id, src, dst))
    pair.sender.abort("early")  # before any layer
    pair.sender.save_layer(0, ["midway"])
    pair.sender.abort("midway")
    pair.sender.save_layer(1, ["early", "midway"])  # no longer ours: ignored
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: {"early", "midway"} <= set(r.failed))
    assert "aborted by the prefill worker" in rlog.failed["early"]
    assert "aborted by the prefill worker" in rlog.failed["midway"]
    _, slog2 = watch(pair.sender, None, 0.2)
    assert not (slog.completed or slog.failed or slog2.completed or slog2.failed)  # abort() is not reported
    assert not any(rows(pair.dst, layer, dst_e).any() for layer in range(LAYERS))
    assert not any(rows(pair.dst, layer, dst_m).any() for layer in range(1, LAYERS))
    assert not pair.medium.leftovers("early", "midway")


@pytest.mark.parametrize("variant", VARIANTS)
def test_forged_messages_are_refused_and_the_receiver_keeps_working(make_pair, variant, caplog):
    pair = make_pair(variant)
    src, dst = random_ids(random.Random(6), 6, 6)
    pair.receiver.expect("f", dst, 10.0)
    # first the message of two parts (a mooncake receiver drops it unlogged: the later refusals show it was seen)
    messages = [[b"two", b"parts"], [b""], [b"junk"], *pair.medium.forgeries(pair, "f", src, dst)]
    pair.medium.inject(pair.receiver.address, messages)
    expected = REFUSALS_LOGGED[pair.transport](messages)

    def refusals() -> int:
        return sum("refused" in record.getMessage() for record in caplog.records)

    rlog, _ = pump(None, pair.receiver, lambda r, s: refusals() >= expected)
    assert not rlog.completed and not rlog.failed  # refused and logged; "f" is still expected
    assert not any(p.any() for p in pair.dst)

    pair.send_all("f", src, dst)
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: r.ended("f") and s.ended("f"))
    assert rlog.completed == ["f"] and slog.completed == ["f"]
    assert all(torch.equal(rows(pair.dst, layer, dst), rows(pair.src, layer, src)) for layer in range(LAYERS))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_layout_mismatch_is_refused(make_pair, variant):
    pair = make_pair(variant, recv_dim=2 * DIM)
    transport = pair.transport
    src, dst = random_ids(random.Random(6), 4, 4)
    pair.receiver.expect("a", dst, 10.0)
    with pytest.raises(KVLayoutMismatch, match=f"head_dim {DIM} vs {2 * DIM}"):
        pair.sender.begin(pair.spec("a", src, dst))
    other = KVLayout.standard(num_layers=LAYERS, block_size=BLOCK * 2, num_kv_heads=HEADS, head_dim=DIM,
                              dtype="bfloat16")
    with pytest.raises(KVLayoutMismatch, match="block_size"):
        pair.sender.begin(pair.spec("e", [0], [0], layout=other))
    if REFUSED_BEGIN_TOLD[transport]:
        rlog, _ = pump(pair.sender, pair.receiver, lambda r, s: "a" in r.failed)
        assert "KV layout mismatch" in rlog.failed["a"] and "--block-size" in rlog.failed["a"]
    else:
        pair.receiver.cancel("a")
    # a spec that misstates the receiver's layout: the receiver checks what arrives itself
    pair.receiver.expect("b", dst, 10.0)
    pair.sender.begin(pair.spec("b", src, dst, layout=pair.sender.layout))
    for layer in range(LAYERS):
        pair.sender.save_layer(layer, ["b"])
    receiver_words, sender_words = misstated_layout(transport, pair.sender.layout.block_bytes, len(dst))
    rlog, slog = pump(pair.sender, pair.receiver, lambda r, s: "b" in r.failed and s.ended("b"))
    assert receiver_words in rlog.failed["b"]
    if sender_words is None:
        assert slog.completed == ["b"]
    else:
        assert sender_words in slog.failed["b"]
    assert not any(pool.any() for pool in pair.dst)


def test_every_transport_is_in_the_contract():
    """A transport added to kvbaton is added here too: in VARIANTS, and in every table of how transports differ."""
    assert sorted({transport_of(v) for v in VARIANTS}) == sorted(TRANSPORTS)
    tables = [SENDER_DONE, RECEIVER_DEADLINE, SENDER_DEADLINE, SENDER_GAVE_UP, RECEIVER_GAVE_UP, NEVER_ANSWERED,
              CANCELLED, REFUSALS_LOGGED, REFUSED_BEGIN_TOLD]
    assert all(sorted(table) == sorted(TRANSPORTS) for table in tables)
    for transport in TRANSPORTS:
        misstated_layout(transport, 1, 1)
