"""KV transfer through a shared Redis store: the sender parks each (request, layer) in a key, the
receiver takes it out.

    prefill                         redis                                   decode
    save_layer(l) -> copy rows ──▶  SET kvbaton:kv:<req>:<xfer>:<l> EX ttl
      (writer thread)               RPUSH <receiver list> signed LayerStored(key, sha256)
                                                          BLPOP (reader thread) ◀──
                                                          GETDEL key, check sha256
                                                          poll(): rows -> pool[dst]

The sender is done once every layer is in the store (the store holds the data; the prefill
worker may free its blocks). Every key, the notification list included, carries a TTL of
`redis_ttl_s`, so nothing outlives an abandoned transfer; the receiver deletes what it reads.
Notifications are SignedCodec frames and carry the data's SHA-256, so a forged notification
or a tampered value is refused — Redis itself is not trusted with integrity.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import redis as redis_py  # NOTE: redis-py (absolute import), not this package (kvbaton.kv.connectors.redis)
from redis.connection import Encoder, PythonRespSerializer

from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.wire import SignedCodec

KEY_PREFIX = "kvbaton:kv:"
MAX_NOTICE_BYTES = 64 * 1024


class LayerStored(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    transfer_id: str  # fresh per begin(): a receiver takes layers of one transfer only
    dst_digest: bytes  # names the destination blocks: data meant for other blocks is refused
    layer: int
    num_layers: int
    key: str
    nbytes: int
    sha256: bytes
    kv_dtype: str  # the sender's KV dtype: a receiver of another converts (kvbaton.kv.convert)


class TransferAborted(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    transfer_id: str
    dst_digest: bytes
    reason: str


Notice = LayerStored | TransferAborted


def codec(secret: bytes) -> SignedCodec:
    return SignedCodec(secret, Notice, MAX_NOTICE_BYTES)


def client(config: ConnectorConfig) -> redis_py.Redis:
    if not config.redis_url:
        raise ValueError("the redis KV transport needs a redis_url (kvbaton serve starts a private redis-server "
                         "when --redis-url is not given)")
    # NOTE: socket_timeout must exceed the BLPOP timeout, or an idle BLPOP reads as a dead server.
    # redis-py's pure-Python command packer sends large values as they are, where the hiredis
    # one copies them first: 2-4x faster SETs of KV layers here (replies still parse with hiredis).
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis_py.Redis.from_url(config.redis_url, socket_connect_timeout=5.0, socket_timeout=30.0,
                                   command_packer=packer)


def data_key(request_id: str, transfer_id: str, layer: int) -> str:
    return f"{KEY_PREFIX}{request_id}:{transfer_id}:{layer}"


def dst_digest(block_ids: list[int]) -> bytes:
    return hashlib.blake2b(np.asarray(block_ids, dtype=np.int64).tobytes(), digest_size=16).digest()
