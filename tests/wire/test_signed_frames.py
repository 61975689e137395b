"""The sequenced codec refuses replayed, reordered, misaddressed, forged and truncated frames, and
admits a new session of a peer only through a hello it has never seen."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.wire import ChannelError, Peer, SequencedCodec

SECRET = b"test-cluster-secret-0123456789"


class Hello(msgspec.Struct, tag="hello"):
    name: str


class Note(msgspec.Struct, tag="note"):
    name: str
    text: str


Msg = Hello | Note


def pair(secret: bytes = SECRET) -> tuple[SequencedCodec, SequencedCodec]:
    """A router-like receiver and a worker-like sender that already said hello."""
    router = SequencedCodec(secret, Msg, Peer.fresh("router"))
    worker = SequencedCodec(secret, Msg, Peer.fresh("w0"))
    worker.trust(router.me)
    router.decode(worker.encode(Hello("w0"), "router"), hello=Hello)
    return router, worker


def test_frames_in_order_are_taken_with_their_header():
    router, worker = pair()
    frames = [worker.encode(Note("w0", str(i)), "router") for i in range(3)]
    got = [router.decode(f) for f in frames]
    assert [r.msg.text for r in got] == ["0", "1", "2"]
    assert [r.header.seq for r in got] == [2, 3, 4]  # the hello was 1
    assert got[0].header.sender == worker.me and got[0].header.recipient == router.me


def test_replay_is_refused_and_changes_nothing():
    router, worker = pair()
    frame = worker.encode(Note("w0", "drain"), "router")
    router.decode(frame)
    with pytest.raises(ChannelError, match="replayed or reordered"):
        router.decode(frame)
    assert router.decode(worker.encode(Note("w0", "next"), "router")).msg.text == "next"


def test_reorder_is_refused():
    router, worker = pair()
    first, second = (worker.encode(Note("w0", t), "router") for t in ("a", "b"))
    router.decode(second)
    with pytest.raises(ChannelError, match=r"seq 2 <= 3"):
        router.decode(first)


def test_streams_of_one_session_are_numbered_independently():
    router, worker = pair()
    heartbeat = worker.for_stream(1)
    late = heartbeat.encode(Note("w0", "beat"), "router")
    router.decode(worker.encode(Note("w0", "out"), "router"))
    assert router.decode(late).header.stream == 1  # overtaken by the other socket's frame, still taken
    with pytest.raises(ChannelError, match="replayed"):
        router.decode(late)


def test_wrong_recipient_is_refused():
    router, worker = pair()
    other_router = SequencedCodec(SECRET, Msg, Peer.fresh("router"))  # same name, another session
    with pytest.raises(ChannelError, match="addressed to 'router' session"):
        other_router.decode(worker.encode(Note("w0", "x"), "router"), hello=Hello)
    w1 = SequencedCodec(SECRET, Msg, Peer.fresh("w1"))
    w1.trust(router.me)
    with pytest.raises(ChannelError, match="addressed to 'w0'"):
        w1.decode(router.encode(Note("router", "drain"), "w0"))  # a command for w0 delivered to w1


def test_unknown_session_needs_a_hello_and_a_replayed_hello_is_refused():
    router, worker = pair()
    stranger = SequencedCodec(SECRET, Msg, Peer.fresh("w9"))
    stranger.trust(router.me)
    with pytest.raises(ChannelError, match="unknown session"):
        router.decode(stranger.encode(Note("w9", "hi"), "router"))
    with pytest.raises(ChannelError, match="Note from an unknown session"):
        router.decode(stranger.encode(Note("w9", "hi"), "router"), hello=Hello)
    hello = stranger.encode(Hello("w9"), "router")
    assert router.decode(hello, hello=Hello).header.sender == stranger.me
    with pytest.raises(ChannelError, match="replayed"):
        router.decode(hello, hello=Hello)


def test_a_restart_replaces_the_session_and_old_frames_stay_refused():
    router, old = pair()
    captured_hello = old.encode(Hello("w0"), "router")  # never delivered: as if captured off the wire
    captured_note = old.encode(Note("w0", "old"), "router")
    new = SequencedCodec(SECRET, Msg, Peer.fresh("w0"))
    new.trust(router.me)
    router.decode(new.encode(Hello("w0"), "router"), hello=Hello)
    assert router.session_of("w0") == new.me.session
    with pytest.raises(ChannelError, match="retired session"):
        router.decode(captured_hello, hello=Hello)  # the old process's hello cannot take the name back
    with pytest.raises(ChannelError, match="retired session"):
        router.decode(captured_note)
    assert router.session_of("w0") == new.me.session


def test_forged_and_truncated_frames_are_refused():
    router, worker = pair()
    frame = worker.encode(Note("w0", "x" * 40), "router")
    forger = SequencedCodec(b"another-cluster-secret-42", Msg, worker.me)
    forger.trust(router.me)
    with pytest.raises(ChannelError, match="bad signature"):
        router.decode(forger.encode(Note("w0", "x"), "router"))
    for cut in (0, 10, 40, len(frame) - 1):
        with pytest.raises(ChannelError, match="too short|bad signature"):
            router.decode(frame[:cut])
    router.decode(frame)  # none of the above advanced the stream


def test_oversized_frames_are_refused_before_the_mac():
    router = SequencedCodec(SECRET, Msg, Peer.fresh("router"), max_frame_bytes=1024)
    with pytest.raises(ChannelError, match="exceeds the 1024-byte limit"):
        router.decode(b"\0" * 1025)


def test_encoding_to_a_peer_without_a_session_is_refused():
    with pytest.raises(ChannelError, match="has not said hello"):
        SequencedCodec(SECRET, Msg, Peer.fresh("router")).encode(Note("r", "x"), "w0")


ROUTER, WORKER = Peer("router", b"r" * 16), Peer("w0", b"w" * 16)


def _valid_frames() -> list[bytes]:
    worker = SequencedCodec(SECRET, Msg, WORKER)
    worker.trust(ROUTER)
    return [worker.encode(Note("w0", "t" * n), "router") for n in (0, 7, 300)]


FRAMES = _valid_frames()


def fresh_router() -> SequencedCodec:
    """A receiver that would take every frame of FRAMES."""
    router = SequencedCodec(SECRET, Msg, ROUTER)
    router.trust(WORKER)
    return router


def test_the_fuzzed_frames_are_valid_before_damage():
    router = fresh_router()
    assert [router.decode(f).msg.text for f in FRAMES] == ["", "t" * 7, "t" * 300]


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """Random bytes, or a valid frame truncated, extended, or with bits flipped."""
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "extended"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    frame = bytearray(draw(st.sampled_from(FRAMES)))
    if kind == "truncated":
        return bytes(frame[:draw(st.integers(0, len(frame) - 1))])
    if kind == "extended":
        return bytes(frame) + draw(st.binary(min_size=1, max_size=16))
    for pos in draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=8, unique=True)):
        frame[pos // 8] ^= 1 << (pos % 8)
    return bytes(frame)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged())
def test_damaged_frames_are_always_channel_errors(frame):
    router = fresh_router()
    with pytest.raises(ChannelError):
        router.decode(frame, hello=Hello)
    assert router.decode(FRAMES[0]).msg.text == ""  # and the refusal changed nothing
