"""A session's KV as one file: what `kvbaton kv save` writes and `kvbaton kv restore` puts back, so a long
conversation's prefix survives a server restart, an eviction or a move to another cluster with the same
secret, and is loaded instead of recomputed (no torch here: the server's frontend handles these files).

    magic (8) | version (4, LE) | header length (4, LE) | header (msgpack SessionHeader)
    | one record per full block of the tokens, in order (`records.py` framing: MAC, key, payload)
    | HMAC-SHA256 over everything before it, under a key derived from the cluster secret

Why signed: a restored block is served to every request whose prompt starts with those tokens, so a
forged file would poison other users' answers. The MAC is checked before anything else is parsed, and
each record's key is recomputed from the header's tokens (and salt), so a file can only hold the KV of the
tokens it names, made by a cluster that knows the secret. Files move between servers that share
KVBATON_CLUSTER_SECRET; without one, a server makes a fresh secret per run. The records inside keep the tiers'
framing, signed under the store's record key of the same secret (redundant under the file's MAC, but one format).
Format 2: that framing changed (format 3 of `records.py`); a format-1 file is refused, naming its format.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvbaton.config import KVStoreConfig
from kvbaton.kv.hashing import chained_block_hashes, salted_root
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.store.base import KVTier, PayloadFiller, PayloadSink
from kvbaton.kv.store.keys import StoreKeys
from kvbaton.kv.store.records import HEADER_BYTES, CorruptRecord, RecordKey, payload_of, write_header

MAGIC = b"KVBSESS\x00"
VERSION = 2
_PREAMBLE = struct.Struct("<8sII")
MAC_BYTES = 32
MAX_HEADER_BYTES = 16 * 2**20  # token ids of the longest context, with room to spare
_KEY_INFO = b"kvbaton/kv-session/v1"  # domain separation: a session MAC is never a valid control signature


class SessionError(ValueError):
    """A session file that cannot be saved or restored here; the message says why."""


class SessionHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    namespace: bytes  # StoreKeys.namespace: the model and KV layout the blocks belong to
    layout: KVLayout
    token_ids: list[int]
    cache_salt: str | None = None


@dataclass(frozen=True)
class StoreTarget:
    """Where a deployment's workers keep KV the server may read and write too: their store config (resolved:
    the shm arena's name, the redis URL), their KV layout, and the model it belongs to."""

    config: KVStoreConfig
    layout: KVLayout
    model_dir: str


@dataclass(frozen=True)
class Session:
    header: SessionHeader
    payloads: list[memoryview]  # one per full block, in order

    @property
    def num_tokens(self) -> int:
        return len(self.payloads) * self.header.layout.block_size


def session_keys(keys: StoreKeys, layout: KVLayout, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
    """The store keys of the full blocks of `token_ids`: what the prefix cache and the tiers call them."""
    return keys.keys(chained_block_hashes(token_ids, layout.block_size, salted_root(cache_salt)))


def export_session(tiers: Sequence[KVTier], keys: StoreKeys, layout: KVLayout, token_ids: list[int],
                   cache_salt: str | None, secret: bytes) -> bytes:
    """The session file of `token_ids`' full blocks, read from the first tier that holds each. SessionError if
    some block is in none of them (not computed yet, or evicted)."""
    block_keys = session_keys(keys, layout, token_ids, cache_salt)
    if not block_keys:
        raise SessionError(f"the prompt has {len(token_ids)} tokens: fewer than one full block of "
                           f"{layout.block_size}, so there is no KV to save")
    header = msgspec.msgpack.encode(SessionHeader(keys.namespace, layout, token_ids, cache_salt))
    record_bytes = HEADER_BYTES + layout.bytes_per_block
    record_key = RecordKey.of_secret(secret)
    out = bytearray(_PREAMBLE.size + len(header) + len(block_keys) * record_bytes + MAC_BYTES)
    _PREAMBLE.pack_into(out, 0, MAGIC, VERSION, len(header))
    out[_PREAMBLE.size:_PREAMBLE.size + len(header)] = header
    view = memoryview(out)
    start = _PREAMBLE.size + len(header)
    for i, key in enumerate(block_keys):
        record = view[start + i * record_bytes:start + (i + 1) * record_bytes]
        if not any(tier.get(key, _copy_into(record[HEADER_BYTES:])) for tier in tiers):
            raise SessionError(f"block {i} of {len(block_keys)} of this prompt is in no shared KV tier (evicted, "
                               "or never computed); send the prompt again and save right after")
        write_header(record, key, layout.bytes_per_block, record_key)
    view[-MAC_BYTES:] = hmac.digest(_mac_key(secret), view[:-MAC_BYTES], "sha256")
    return bytes(out)


def read_session(data: bytes | memoryview, keys: StoreKeys, layout: KVLayout, secret: bytes,
                 max_tokens: int) -> Session:
    """A session file checked to be ours and whole: signed with our secret, for our model and KV layout, at
    most `max_tokens` long, and every record the KV of the block its header's tokens name. Else SessionError."""
    view = memoryview(data)
    if len(view) < _PREAMBLE.size + MAC_BYTES:
        raise SessionError("not a kvbaton KV session file (too short)")
    magic, version, header_len = _PREAMBLE.unpack_from(view, 0)
    if magic != MAGIC:
        raise SessionError("not a kvbaton KV session file")
    if version != VERSION:
        raise SessionError(f"KV session format {version}; this server reads format {VERSION}")
    expected = hmac.digest(_mac_key(secret), view[:-MAC_BYTES], "sha256")
    if not hmac.compare_digest(expected, view[-MAC_BYTES:]):
        raise SessionError("the session file's signature does not verify: it was saved by a server with another "
                           "cluster secret (set the same KVBATON_CLUSTER_SECRET on both), or altered")
    if header_len > min(MAX_HEADER_BYTES, len(view) - _PREAMBLE.size - MAC_BYTES):
        raise SessionError("the session file's header is malformed")
    try:
        header = msgspec.msgpack.decode(view[_PREAMBLE.size:_PREAMBLE.size + header_len], type=SessionHeader)
    except msgspec.ValidationError as exc:  # DecodeError is one
        raise SessionError(f"the session file's header is malformed: {exc}") from None
    if header.namespace != keys.namespace or header.layout != layout:
        raise SessionError(f"the session was saved from another model or KV layout (KV dtype {header.layout.dtype}, "
                           f"block size {header.layout.block_size}; this server: {layout.dtype}, {layout.block_size})")
    if len(header.token_ids) > max_tokens:
        raise SessionError(f"the session has {len(header.token_ids)} tokens, more than this server's context of "
                           f"{max_tokens}")
    block_keys = session_keys(keys, layout, header.token_ids, header.cache_salt)
    record_bytes = HEADER_BYTES + layout.bytes_per_block
    body = view[_PREAMBLE.size + header_len:-MAC_BYTES]
    if len(body) != len(block_keys) * record_bytes:
        raise SessionError(f"the session file holds {len(body)} bytes of blocks where its {len(header.token_ids)} "
                           f"tokens need {len(block_keys) * record_bytes}")
    record_key = RecordKey.of_secret(secret)
    try:
        payloads = [payload_of(body[i * record_bytes:(i + 1) * record_bytes], key, layout.bytes_per_block,
                               record_key) for i, key in enumerate(block_keys)]
    except CorruptRecord as exc:
        raise SessionError(f"a block of the session file does not match its tokens: {exc}") from None
    return Session(header, payloads)


def restore_session(tiers: Sequence[KVTier], session: Session) -> int:
    """Put every block of `session` into every tier (fastest first); the number of blocks at least one tier
    took. The next request whose prompt starts with the session's tokens loads them."""
    header = session.header
    block_keys = session_keys(StoreKeys(header.namespace), header.layout, header.token_ids, header.cache_salt)
    stored = 0
    for key, payload in zip(block_keys, session.payloads):
        stored += any([tier.put(key, _copy_from(payload)) for tier in tiers])  # a list: every tier gets it
    for tier in tiers:
        tier.flush()
    return stored


def _mac_key(secret: bytes) -> bytes:
    return hmac.digest(secret, _KEY_INFO, "sha256")


def _copy_into(dst: memoryview) -> PayloadSink:
    def sink(payload: memoryview) -> None:
        dst[:] = memoryview(payload).cast("B")
    return sink


def _copy_from(src: memoryview) -> PayloadFiller:
    def fill(buffer: memoryview) -> None:
        memoryview(buffer).cast("B")[:len(src)] = src
    return fill
