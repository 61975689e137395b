"""The framing of a block outside memory (disk files, Redis values): a header that names its key
and a checksum over key and payload, so a torn write, a flipped bit or a file renamed onto another
key reads as a miss, never as someone else's KV.

    magic (4) | version (1) | reserved (3) | key (KEY_BYTES) | payload length (8, LE) | CRC-32 (4) | pad (4) | payload

NOTE: CRC-32 (zlib, ~4 GB/s here), not a cryptographic digest (blake2b ran at 0.5 GB/s, 7x slower than
reading the file): it guards against accidents (torn writes, flipped bits, a file moved onto another
key's name, which the stored key catches), not against someone who may write the tier's files or
keys, who could forge any checksum we did not key with a secret.
"""

from __future__ import annotations

import struct
import zlib

from kvbaton.kv.store.keys import KEY_BYTES

MAGIC = b"KVBK"
VERSION = 2
_HEAD = struct.Struct(f"<4sB3x{KEY_BYTES}sQI4x")
HEADER_BYTES = _HEAD.size


class CorruptRecord(ValueError):
    """A stored block whose header or checksum does not match what was asked for."""


def checksum(key: bytes, payload: memoryview | bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key))


def write_header(buffer: memoryview, key: bytes, payload_bytes: int) -> None:
    """Fill the header at the front of `buffer`, whose payload (after HEADER_BYTES) is written already."""
    payload = buffer[HEADER_BYTES:HEADER_BYTES + payload_bytes]
    _HEAD.pack_into(buffer, 0, MAGIC, VERSION, key, payload_bytes, checksum(key, payload))


def payload_of(record: memoryview | bytes, key: bytes, payload_bytes: int) -> memoryview:
    """The payload of `record`, after checking it is `key`'s, whole and unchanged; else CorruptRecord."""
    view = memoryview(record)
    if len(view) != HEADER_BYTES + payload_bytes:
        raise CorruptRecord(f"record of {len(view)} bytes, expected {HEADER_BYTES + payload_bytes}")
    magic, version, stored_key, length, digest = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or length != payload_bytes:
        raise CorruptRecord("bad record header")
    if stored_key != key:
        raise CorruptRecord("record holds another key")
    payload = view[HEADER_BYTES:]
    if checksum(key, payload) != digest:
        raise CorruptRecord("checksum mismatch")
    return payload
