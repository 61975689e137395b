"""Typed messages between a frontend and an engine-core process (msgpack via msgspec).

Only these types cross the socket; decoding anything else fails. Never pickle: untrusted
bytes must not be able to run code in a worker.
"""

from __future__ import annotations

import msgspec

from kvbaton.engine.info import EngineInfo, EngineStats
from kvbaton.engine.outputs import EngineCoreOutput
from kvbaton.engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    reason: str = "abort"  # "abort" (client gone) | "stop" (the frontend saw a stop string)


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CoreReady(msgspec.Struct, tag="ready"):
    info: EngineInfo
    pid: int


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats


class CoreRequestError(msgspec.Struct, tag="error"):
    request_id: str
    message: str


ToCore = AddRequest | AbortRequests | Shutdown
FromCore = CoreReady | CoreOutputs | CoreRequestError

MAX_MESSAGE_BYTES = 64 * 2**20  # a frame larger than this is refused unread


class Codec:
    """Encoder/decoder pair for one direction of the channel."""

    def __init__(self, decode_type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes):
        return self._decoder.decode(data)
