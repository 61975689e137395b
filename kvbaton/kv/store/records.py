"""The framing of a block outside memory (disk files, Redis values, Mooncake objects): a header that names its key
and a MAC over key, length and payload under a key derived from the cluster secret, so a torn write, a flipped bit,
a file renamed onto another key's name, or a record planted by anyone who may write the tier but lacks the secret
reads as a miss, never as KV.

    magic (4) | version (1) | reserved (3) | MAC (16) | key (KEY_BYTES) | payload length (8, LE) | payload
                                                      └──────── the MAC covers these, one span ────────┘

Why keyed: store keys are content addresses anyone can compute (`keys.py`), and a block found under one is served
to every prompt that starts with those tokens. Under format 2's CRC-32, whoever could write the tier (a Redis client
with its password, any host reaching the Mooncake store, whoever holds the disk directory's owner's rights) could plant
KV for any prompt and recompute the checksum. Now a record verifies only under `RecordKey.of_secret(secret)`, so every
process that shares a store must share KVBATON_CLUSTER_SECRET (as session files and the control channel do).

Format 3 (this one): records of format 2 read as misses (counted corrupt, like any bad record) and are written again
as their blocks are saved again. A record proves a holder of the secret wrote it for that key, not when: a replayed
record of the same key is the same tokens' KV (keys are content addresses), so replay gains nothing.

NOTE: HMAC-SHA256 through `hmac.digest` (OpenSSL's one-shot C path): 465 us to sign or to check a 720 KiB block
(SmolLM2-135M, fp32, 16 tokens; 1.6 GB/s), where CRC-32 took 160 us and keyed blake2b 850 us, on an
"Intel(R) Xeon(R) Processor" (lscpu; SHA-NI), Python 3.11, load ~4 on 2 cores; with the cores busier, 1.07 ms (CRC-32
0.35 ms). Paid once per block written and once per block read; the tiers' own I/O is not in these figures.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass, field

from kvbaton.kv.store.keys import KEY_BYTES

MAGIC = b"KVBK"
VERSION = 3
# NOTE: truncated to 16 bytes (128 bits), as TLS and IPsec truncate HMACs: a forger's chance per try is 2^-128
MAC_BYTES = 16
_HEAD = struct.Struct(f"<4sB3x{MAC_BYTES}s{KEY_BYTES}sQ")
_MAC_AT = 8
_SIGNED_AT = _MAC_AT + MAC_BYTES  # key, length and payload: everything after the MAC
HEADER_BYTES = _HEAD.size
_KEY_INFO = b"kvbaton kv-store records v1"  # domain separation: a record MAC is never a control or session MAC


class CorruptRecord(ValueError):
    """A stored block whose header or MAC does not match what was asked for."""


@dataclass(frozen=True)
class RecordKey:
    """The key that signs and checks a store's records. Processes that share a tier (workers, the server's session
    endpoints, a restarted server over the same disk directory) must derive it from the same cluster secret."""

    mac_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.mac_key) != 32:
            raise ValueError("a record key is 32 bytes: make it with RecordKey.of_secret")

    @classmethod
    def of_secret(cls, secret: bytes) -> RecordKey:
        if len(secret) < 16:
            raise ValueError("cluster secret must be at least 16 bytes")
        return cls(hmac.digest(secret, _KEY_INFO, "sha256"))

    def mac(self, signed: memoryview) -> bytes:
        return hmac.digest(self.mac_key, signed, "sha256")[:MAC_BYTES]


def write_header(buffer: memoryview, key: bytes, payload_bytes: int, record_key: RecordKey) -> None:
    """Fill the header at the front of `buffer`, whose payload (after HEADER_BYTES) is written already."""
    _HEAD.pack_into(buffer, 0, MAGIC, VERSION, b"", key, payload_bytes)
    buffer[_MAC_AT:_SIGNED_AT] = record_key.mac(buffer[_SIGNED_AT:HEADER_BYTES + payload_bytes])


def payload_of(record: memoryview | bytes, key: bytes, payload_bytes: int, record_key: RecordKey) -> memoryview:
    """The payload of `record`, after checking it is `key`'s, whole, and signed under `record_key`; else
    CorruptRecord (also for a record another cluster secret signed: to this process, a forgery)."""
    view = memoryview(record)
    if len(view) != HEADER_BYTES + payload_bytes:
        raise CorruptRecord(f"record of {len(view)} bytes, expected {HEADER_BYTES + payload_bytes}")
    magic, version, digest, stored_key, length = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or length != payload_bytes:
        raise CorruptRecord("bad record header")
    if stored_key != key:
        raise CorruptRecord("record holds another key")
    if not hmac.compare_digest(record_key.mac(view[_SIGNED_AT:]), digest):
        raise CorruptRecord("MAC mismatch: altered, or signed under another cluster secret")
    return view[HEADER_BYTES:]
