"""Authenticated, typed frames between kvbaton processes (router <-> worker, worker <-> worker).

Every frame is `HMAC-SHA256(secret, payload) || payload`, where the payload is msgpack of
one of the channel's msgspec types (or raw bytes, for KV data). A frame that is too big,
unsigned, signed with another secret, or not one of the expected types is refused and
logged; nothing received is ever unpickled or `torch.load`ed — unauthenticated pickle on
ZeroMQ sockets is how PD-disaggregation stacks got remote-code-execution CVEs
(CVE-2025-30165, CVE-2025-32444, CVE-2026-3060, CVE-2026-26220).

A signed frame proves who may have sent it, not when or to whom: the router <-> worker channel,
where a replayed `Drain` or output would act twice, uses `SequencedCodec` (sequenced.py) instead.

The cluster secret comes from `KVBATON_CLUSTER_SECRET`, or is made
fresh by the launcher and handed to the workers it starts (via the environment, never argv,
so `ps` does not show it).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from typing import Any

import msgspec

from kvbaton.wire.codec import MAX_CONTROL_FRAME_BYTES, ChannelError, Codec

logger = logging.getLogger(__name__)

SECRET_ENV = "KVBATON_CLUSTER_SECRET"
MAC_BYTES = 32

def cluster_secret() -> bytes:
    """The secret from the environment, or a new random one (which the launcher then passes on)."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value.encode()
    return secrets.token_hex(32).encode()


class SignedCodec:
    """Sign-and-encode / verify-and-decode for one message union over one secret."""

    def __init__(self, secret: bytes, decode_type: Any, max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES) -> None:
        if len(secret) < 16:
            raise ValueError("cluster secret must be at least 16 bytes")
        self._secret = secret
        self._codec = Codec(decode_type, max_frame_bytes)
        self.max_frame_bytes = max_frame_bytes

    def sign(self, payload: bytes | memoryview) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    def encode(self, msg: msgspec.Struct) -> bytes:
        payload = self._codec.encode(msg)
        return self.sign(payload) + payload

    def verify(self, frame: bytes | memoryview) -> memoryview:
        """The payload of a correctly signed frame, else ChannelError."""
        view = memoryview(frame)
        if len(view) > self.max_frame_bytes:
            raise ChannelError(f"frame of {len(view)} bytes exceeds the {self.max_frame_bytes}-byte limit")
        if len(view) < MAC_BYTES:
            raise ChannelError(f"frame of {len(view)} bytes is too short to be signed")
        mac, payload = view[:MAC_BYTES], view[MAC_BYTES:]
        if not hmac.compare_digest(self.sign(payload), mac):
            raise ChannelError("bad signature (unauthenticated sender or another cluster's secret)")
        return payload

    def decode(self, frame: bytes | memoryview) -> Any:
        return self._codec.decode(self.verify(frame))

    def try_decode(self, frame: bytes | memoryview, where: str) -> Any:
        """decode(), but a refused frame is logged and gives None: one bad peer must not stop a worker."""
        try:
            return self.decode(frame)
        except ChannelError as exc:
            logger.warning("%s: refused a frame (%d bytes): %s", where, len(frame), exc)
            return None
