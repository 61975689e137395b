"""Plain msgspec codecs: typed msgpack in and out, for one message union per direction.

Only the declared types decode; anything else is a `ChannelError`. Never pickle: untrusted
bytes must not be able to run code in a kvbaton process.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_CONTROL_FRAME_BYTES = 64 * 2**20  # control messages; KV data frames have their own limits


class ChannelError(ValueError):
    """A frame was refused (unsigned, forged, oversized, or not a known message)."""


class MalformedMessage(ChannelError):
    """A frame whose message does not decode as its type: after authentication, a value one side accepts
    and the other refuses (a float the receiver's CPU flushes to zero, a version skew). `request_id` names
    the request it was about, when it has one, so the receiver can fail that request instead of leaving
    it to hang."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def _request_id_of(frame: bytes | memoryview) -> str | None:
    try:
        fields = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    request_id = fields.get("request_id") if isinstance(fields, dict) else None
    return request_id if isinstance(request_id, str) else None


class Codec:
    """Encoder/decoder pair for one message union (`decode_type`)."""

    def __init__(self, decode_type: Any, max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self.max_frame_bytes = max_frame_bytes

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview) -> Any:
        if len(frame) > self.max_frame_bytes:
            raise ChannelError(f"frame of {len(frame)} bytes exceeds the {self.max_frame_bytes}-byte limit")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            raise MalformedMessage(f"malformed message: {exc}", _request_id_of(frame)) from exc
        except msgspec.DecodeError as exc:
            raise ChannelError(f"malformed message: {exc}") from exc
