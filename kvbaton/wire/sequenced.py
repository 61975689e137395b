"""Sequenced frames: signed, and bound to their sender, their recipient and their place in a stream,
so a captured frame cannot be replayed, reordered or redirected (router <-> worker control channel).

    frame  = MAC(32) | header | payload            MAC = HMAC-SHA256(secret, header | payload)
    header = version(1) stream(1) seq(8) sender session(16) recipient session(16)
             len(sender name)(1) len(recipient name)(1) sender name  recipient name

A *session* is a random 16-byte nonce an endpoint draws when it starts (`Peer.fresh`): a restarted
process is a new session, so nothing captured from its previous life is addressed to it. A *stream*
is one socket (and thread) of a session, numbering its frames 1, 2, 3, ...; frames of one stream
travel one ZeroMQ connection, in order, so a receiver takes a frame only if its number is above the
last one it took from that stream (replay, reorder). Streams of one session (a worker's events and
its heartbeat thread) are numbered independently: they travel different sockets.

Which sessions a receiver takes frames from is explicit: one it was told of (`trust`: a worker
learns the router's session from its spec), or one announced by a hello (`decode(hello=...)`)
whose session this receiver has never seen; a replayed hello names a session already seen, and
an old one is addressed to another session of the recipient, so neither can take over a peer.

The KV connectors keep the plain `SignedCodec`: their frames are scoped to one transfer of one
request, and their receivers drop what does not match a transfer in flight.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
from typing import Any, NamedTuple

import msgspec

from kvbaton.wire.codec import MAX_CONTROL_FRAME_BYTES, ChannelError, Codec, MalformedMessage
from kvbaton.wire.signed import MAC_BYTES

logger = logging.getLogger(__name__)

VERSION = 1
SESSION_BYTES = 16
_FIXED = struct.Struct(">BBQ16s16sBB")  # version, stream, seq, sender session, recipient session, name lengths
MIN_FRAME_BYTES = MAC_BYTES + _FIXED.size


class Peer(NamedTuple):
    """One end of a channel: its name, and the session it speaks in (random per process start)."""

    name: str
    session: bytes

    @classmethod
    def fresh(cls, name: str) -> Peer:
        return cls(name, secrets.token_bytes(SESSION_BYTES))


class Header(NamedTuple):
    sender: Peer
    recipient: Peer
    stream: int
    seq: int


class Received(NamedTuple):
    header: Header
    msg: Any


class SequencedCodec:
    """Sign-number-address / verify-check-decode for one endpoint (`me`) and one inbound message union.

    Contract: `encode` numbers its frames 1, 2, 3, ... in stream `stream` (one codec per socket and
    thread); `decode` returns a frame only if it is signed with the secret, addressed to `me`
    (name and session), from a trusted session (`trust`, or a hello it admits), and numbered above
    the last frame it took from that sender's stream; anything else is a ChannelError and changes
    nothing. Not thread-safe."""

    def __init__(self, secret: bytes, decode_type: Any, me: Peer, *, stream: int = 0,
                 max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES) -> None:
        if len(secret) < 16:
            raise ValueError("cluster secret must be at least 16 bytes")
        if len(me.session) != SESSION_BYTES or not 0 <= stream < 256:
            raise ValueError(f"a session is {SESSION_BYTES} bytes and a stream 0-255")
        self.me, self.stream, self.max_frame_bytes = me, stream, max_frame_bytes
        self._secret, self._decode_type = secret, decode_type
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)  # keyed once; copied per frame
        self._codec = Codec(decode_type, max_frame_bytes)
        self._me_name = _name_bytes(me.name)
        self._seq = 0
        self._sessions: dict[str, bytes] = {}  # name -> the session trusted for it now
        self._names: dict[bytes, str] = {}  # the reverse
        self._last: dict[tuple[bytes, int], int] = {}  # (session, stream) -> last seq taken
        self._seen: set[bytes] = set()  # every session ever trusted: a hello naming one is a replay

    def for_stream(self, stream: int) -> SequencedCodec:
        """A codec for another socket (and thread) of the same session, trusting the same peers."""
        sibling = SequencedCodec(self._secret, self._decode_type, self.me, stream=stream,
                                 max_frame_bytes=self.max_frame_bytes)
        for name, session in self._sessions.items():
            sibling.trust(Peer(name, session))
        return sibling

    def trust(self, peer: Peer) -> None:
        """Take frames from `peer`'s session from now on; an earlier session of that name is dropped."""
        old = self._sessions.get(peer.name)
        if old is not None and old != peer.session:
            del self._names[old]
            for key in [k for k in self._last if k[0] == old]:
                del self._last[key]
        self._sessions[peer.name] = peer.session
        self._names[peer.session] = peer.name
        self._seen.add(peer.session)

    def session_of(self, name: str) -> bytes | None:
        return self._sessions.get(name)

    # ---- out -------------------------------------------------------------------------------

    def encode(self, msg: msgspec.Struct, to: str) -> bytes:
        """`msg` as the next frame of this stream, addressed to the trusted session of `to`."""
        session = self._sessions.get(to)
        if session is None:
            raise ChannelError(f"no session with {to!r} (it has not said hello)")
        self._seq += 1
        recipient = _name_bytes(to)
        header = _FIXED.pack(VERSION, self.stream, self._seq, self.me.session, session, len(self._me_name),
                             len(recipient)) + self._me_name + recipient
        payload = self._codec.encode(msg)
        mac = self._mac.copy()
        mac.update(header)
        mac.update(payload)
        return b"".join((mac.digest(), header, payload))

    # ---- in --------------------------------------------------------------------------------

    def decode(self, frame: bytes | memoryview, *, hello: type | None = None) -> Received:
        """The frame's header and message, else ChannelError. With `hello`, a message of that type
        from a session never seen before is admitted, and its session trusted from now on."""
        view = memoryview(frame)
        header, payload = self._open(view)
        key = (header.sender.session, header.stream)
        known = self._names.get(header.sender.session) == header.sender.name
        last = self._last.get(key, 0)
        if known:
            if header.seq <= last:
                raise ChannelError(f"replayed or reordered frame from {header.sender.name} "
                                   f"(seq {header.seq} <= {last})")
        elif header.sender.session in self._seen:
            raise ChannelError(f"frame from a retired session of {header.sender.name!r} (a replayed hello?)")
        elif hello is None:
            raise ChannelError(f"frame from an unknown session of {header.sender.name!r}")
        try:
            msg = self._codec.decode(payload)
        except MalformedMessage:
            if known:
                self._last[key] = header.seq  # authentic and in order, only unreadable: consumed
            raise
        if not known:
            if hello is None or not isinstance(msg, hello):
                raise ChannelError(f"{type(msg).__name__} from an unknown session of {header.sender.name!r}")
            self.trust(header.sender)
        self._last[key] = header.seq
        return Received(header, msg)

    def try_decode(self, frame: bytes | memoryview, where: str, *, hello: type | None = None) -> Received | None:
        """decode(), but a refused frame is logged and gives None: one bad peer must not stop a worker."""
        try:
            return self.decode(frame, hello=hello)
        except ChannelError as exc:
            logger.warning("%s: refused a frame (%d bytes): %s", where, len(frame), exc)
            return None

    def _open(self, view: memoryview) -> tuple[Header, memoryview]:
        """Check the size and MAC, parse the header, check it is addressed to me."""
        if len(view) > self.max_frame_bytes:
            raise ChannelError(f"frame of {len(view)} bytes exceeds the {self.max_frame_bytes}-byte limit")
        if len(view) < MIN_FRAME_BYTES:
            raise ChannelError(f"frame of {len(view)} bytes is too short to be signed")
        mac = self._mac.copy()
        mac.update(view[MAC_BYTES:])
        if not hmac.compare_digest(mac.digest(), view[:MAC_BYTES]):
            raise ChannelError("bad signature (unauthenticated sender or another cluster's secret)")
        # NOTE: past the MAC the header was written by a holder of the secret; still checked, not trusted
        version, stream, seq, session, to_session, n_from, n_to = _FIXED.unpack_from(view, MAC_BYTES)
        start = MAC_BYTES + _FIXED.size
        end = start + n_from + n_to
        if version != VERSION or len(view) < end:
            raise ChannelError(f"unknown frame version {version} or truncated header")
        recipient = bytes(view[start + n_from:end])
        if recipient != self._me_name or to_session != self.me.session:
            raise ChannelError(f"frame addressed to {recipient.decode(errors='replace')!r} session "
                               f"{to_session.hex()[:8]}, not this {self.me.name!r} session {self.me.session.hex()[:8]}")
        try:
            sender = str(view[start:start + n_from], "utf-8")
        except UnicodeDecodeError as exc:
            raise ChannelError("the sender's name is not UTF-8") from exc
        header = Header(Peer(sender, session), self.me, stream, seq)
        return header, view[end:]


def _name_bytes(name: str) -> bytes:
    raw = name.encode()
    if len(raw) > 255:
        raise ValueError(f"endpoint name longer than 255 bytes: {name[:40]!r}...")
    return raw
