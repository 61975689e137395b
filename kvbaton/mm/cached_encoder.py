"""An image encoder behind a worker's encoder cache and, when the deployment shares a KV tier, the shared level
(`shared_encodings.py`): what an encoder worker and an engine core that encodes its own images (`--encode 0`) both
run. Every image's embeddings are held for the request that asked for them until it is released.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from kvbaton.config import KVStoreConfig
from kvbaton.mm.embeddings import DTYPE_NAMES, from_bytes, to_bytes
from kvbaton.mm.encoder_cache import EncoderCache
from kvbaton.mm.images import DecodedImage
from kvbaton.mm.shared_encodings import SharedEncodings
from kvbaton.mm.vision import ImageEncoder, load_image_encoder
from kvbaton.sched.info import EncoderCacheStats


class CachedEncoder:
    def __init__(self, encoder: ImageEncoder, cache: EncoderCache[torch.Tensor], dtype: torch.dtype,
                 shared: SharedEncodings | None = None) -> None:
        self.encoder, self.cache, self.dtype, self.shared = encoder, cache, dtype, shared
        self.encoded = 0  # images run through the tower
        self.busy_s = 0.0  # the time it took

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, cache_mb: float,
             store: KVStoreConfig | None = None) -> CachedEncoder | None:
        """The checkpoint's encoder (None for a text-only model), its cache of `cache_mb`, and the shared level
        over `store`'s first shared tier, if it has one."""
        encoder = load_image_encoder(model_dir, dtype)
        if encoder is None:
            return None
        shared = SharedEncodings.open(store, model_dir, DTYPE_NAMES[dtype]) if store is not None else None
        return cls(encoder, EncoderCache(int(cache_mb * 2**20)), dtype, shared)

    def encode(self, request_id: str, images: list[DecodedImage]) -> list[torch.Tensor]:
        """Each image's embeddings: from this worker's cache, else the shared level, else the tower (the new
        ones stored in both); all of them held for `request_id` until `release`."""
        cache = self.cache
        found = [cache.acquire(request_id, im.digest) for im in images]
        try:
            if self.shared is not None:
                for i in [i for i, e in enumerate(found) if e is None]:
                    found[i] = self._from_shared(request_id, images[i].digest)
            missing = [i for i, e in enumerate(found) if e is None]
            if missing:
                start = time.perf_counter()
                encoded = self.encoder.encode([images[i] for i in missing])
                self.busy_s += time.perf_counter() - start
                self.encoded += len(missing)
                for i, e in zip(missing, encoded):
                    cache.put(request_id, images[i].digest, e, e.nbytes)
                    found[i] = e
                    if self.shared is not None:
                        self.shared.put(images[i].digest, to_bytes(e))
        except Exception:
            cache.release(request_id)
            raise
        return [e for e in found if e is not None]

    def _from_shared(self, request_id: str, digest: str) -> torch.Tensor | None:
        assert self.shared is not None
        sent = self.shared.get(digest)
        if sent is None:
            return None
        try:
            e = from_bytes(sent)
        except ValueError:
            return None  # a record that is not what it claims: encode instead
        if e.dtype != self.dtype:
            return None
        return self.cache.keep(request_id, digest, e, e.nbytes)

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)

    def stats(self) -> EncoderCacheStats:
        shared_hits = self.shared.hits if self.shared is not None else 0
        return replace(self.cache.stats(), shared_hits=shared_hits)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
