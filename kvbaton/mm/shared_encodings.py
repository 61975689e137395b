"""The encoder cache's second level: embeddings in the deployment's shared KV tier (shm on one host, redis or
mooncake across hosts), so an image one worker encoded is not encoded again by another (an encoder worker of the
pool, or a replica encoding its own images).

Best effort, like every tier: a record is cut into chunks of `CHUNK_BYTES` (the tier stores fixed-size payloads),
each under its own key; the tiers that cross processes' trust (redis, mooncake) sign and check every chunk
(`kv/store/records.py`) under the cluster secret. A chunk missing, evicted or refused is a miss, and a miss only
means encoding again. The first chunk starts with a header naming the image, so a record read back is the one asked
for, whole, or nothing.

Keys: a namespace of the model's fingerprint, its image processor's settings and the dtype (so embeddings of
another checkpoint, another preprocessing or another dtype never mix), then the pixel digest and the chunk's index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import struct
from pathlib import Path

from kvbaton.config import KVStoreConfig, image_processor_settings
from kvbaton.kv.hashing import HASH_BYTES
from kvbaton.kv.store.base import KVTier
from kvbaton.kv.store.factory import store_record_key
from kvbaton.kv.store.keys import NAMESPACE_BYTES, model_fingerprint
from kvbaton.kv.store.tiers import SHARED_TIERS, open_tier
from kvbaton.mm.embeddings import DTYPES, EmbeddingBytes

logger = logging.getLogger(__name__)
CHUNK_BYTES = 64 * 1024
_HEADER = struct.Struct("<4s32sBIIQ")  # magic, the pixel digest, dtype, rows, cols, data bytes
_MAGIC = b"KBE1"
_DTYPE_CODES = {name: i for i, name in enumerate(sorted(DTYPES))}
_DTYPE_NAMES = {i: name for name, i in _DTYPE_CODES.items()}
SHARE_OF_TIER = 4  # the arena or quota the embeddings may take: this fraction of the KV tier's (1/4)


class SharedEncodings:
    def __init__(self, tier: KVTier, namespace: bytes) -> None:
        if tier.payload_bytes != CHUNK_BYTES:
            raise ValueError(f"the tier's payloads are {tier.payload_bytes} bytes, not {CHUNK_BYTES}")
        self.tier, self.namespace = tier, namespace
        self.hits = self.misses = 0

    @classmethod
    def open(cls, config: KVStoreConfig, model_dir: Path, dtype: str) -> SharedEncodings | None:
        """Over the first shared tier `config` names (None without one)."""
        name = next((t for t in config.ordered_tiers if t in SHARED_TIERS), None)
        if name is None:
            return None
        share = dataclasses.replace(config, shm_gb=config.shm_gb / SHARE_OF_TIER,
                                    redis_gb=config.redis_gb / SHARE_OF_TIER,
                                    mooncake_gb=config.mooncake_gb / SHARE_OF_TIER)
        tier = open_tier(name, share, CHUNK_BYTES, store_record_key())
        settings = json.dumps(image_processor_settings(Path(model_dir)), sort_keys=True).encode()
        text = b"\x00".join([b"kvbaton-encodings", model_fingerprint(model_dir).encode(),
                             hashlib.sha256(settings).digest(), dtype.encode()])
        logger.info("image embeddings shared through the %s tier", name)
        return cls(tier, hashlib.blake2b(text, digest_size=NAMESPACE_BYTES).digest())

    def get(self, digest: str) -> EmbeddingBytes | None:
        """`digest`'s embeddings if the tier holds every chunk of them (None: a miss)."""
        found = self._read(digest)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, digest: str, embeddings: EmbeddingBytes) -> bool:
        """Store `digest`'s embeddings; False when the tier skipped a chunk (it then stays a miss for others)."""
        record = _HEADER.pack(_MAGIC, bytes.fromhex(digest), _DTYPE_CODES[embeddings.dtype], embeddings.rows,
                              embeddings.cols, len(embeddings.data)) + embeddings.data
        chunks = [record[i:i + CHUNK_BYTES] for i in range(0, len(record), CHUNK_BYTES)]
        stored = True
        for index in reversed(range(len(chunks))):  # the header last: a reader that finds it finds the rest
            chunk = chunks[index]

            def fill(buffer: memoryview, chunk: bytes = chunk) -> None:
                buffer[:len(chunk)] = chunk
                buffer[len(chunk):] = bytes(len(buffer) - len(chunk))

            stored = self.tier.put(self._key(digest, index), fill) and stored
        return stored

    def close(self) -> None:
        self.tier.close()

    def _read(self, digest: str) -> EmbeddingBytes | None:
        first = self._chunk(digest, 0)
        if first is None:
            return None
        magic, named, dtype, rows, cols, nbytes = _HEADER.unpack_from(first)
        if magic != _MAGIC or named != bytes.fromhex(digest) or dtype not in _DTYPE_NAMES:
            return None  # (another record under a colliding key: a miss, never someone else's image)
        total = _HEADER.size + nbytes
        record = bytearray(first)
        for index in range(1, -(-total // CHUNK_BYTES)):
            chunk = self._chunk(digest, index)
            if chunk is None:
                return None
            record += chunk
        data = bytes(record[_HEADER.size:total])
        if rows * cols * DTYPES[_DTYPE_NAMES[dtype]].itemsize != nbytes:
            return None
        return EmbeddingBytes(_DTYPE_NAMES[dtype], rows, cols, data)

    def _chunk(self, digest: str, index: int) -> bytes | None:
        out: list[bytes] = []
        if not self.tier.get(self._key(digest, index), lambda payload: out.append(bytes(payload))):
            return None
        return out[0]

    def _key(self, digest: str, index: int) -> bytes:
        name = hashlib.blake2b(bytes.fromhex(digest) + index.to_bytes(4, "little"), digest_size=HASH_BYTES).digest()
        return self.namespace + name
