"""A worker's encoder cache: each image's embeddings by the digest of its decoded pixels, so an image seen again
skips its encoder.

An entry is held while a request that needs it lives (reference-counted by request id: its prompt may be computed
again after a preemption), whatever its size; once no request holds it, it stays only while the unheld entries fit
in `max_bytes`, the least recently used leaving first. So nothing outlives its last user beyond the byte bound (the
reference connector of vLLM's encoder cache never freed its entries), and a miss is only a miss: the engine encodes
the image again, it never asserts.

Torch-free: the values are whatever the encoder returns, priced by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvbaton.sched.info import EncoderCacheStats

V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    value: V
    nbytes: int
    holders: set[str] = field(default_factory=set)


class EncoderCache(Generic[V]):
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry[V]] = {}
        self._unheld: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._unheld_bytes = 0
        self._held_by: dict[str, list[str]] = {}  # request id -> digests it holds
        self._hits = self._misses = self._evictions = 0

    def acquire(self, request_id: str, digest: str) -> V | None:
        """The cached embeddings of `digest`, now held by `request_id`; None (a miss) if not cached."""
        entry = self._entries.get(digest)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        self._hold(request_id, digest, entry)
        return entry.value

    def put(self, request_id: str, digest: str, value: V, nbytes: int) -> None:
        """`digest`'s embeddings just encoded for `request_id`, held by it."""
        entry = self._entries.get(digest)
        if entry is None:  # (two requests of one batch may encode the same image: the first one's stays)
            entry = self._entries[digest] = _Entry(value, nbytes)
        self._hold(request_id, digest, entry)

    def keep(self, request_id: str, digest: str, value: V, nbytes: int) -> V:
        """`digest`'s embeddings encoded elsewhere (an encoder worker's, E/P/D), held by `request_id` as if encoded
        here; neither a hit nor a miss (this cache did not decide whether to encode). Returns the entry's value
        (an entry already cached stays)."""
        entry = self._entries.get(digest)
        if entry is None:
            entry = self._entries[digest] = _Entry(value, nbytes)
        self._hold(request_id, digest, entry)
        return entry.value

    def release(self, request_id: str) -> None:
        """`request_id` ended: the entries it held that no other request holds become unheld (then bounded)."""
        for digest in self._held_by.pop(request_id, ()):
            entry = self._entries[digest]
            entry.holders.discard(request_id)
            if not entry.holders:
                self._unheld[digest] = None
                self._unheld_bytes += entry.nbytes
        self._evict()

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self._hits, self._misses, self._evictions,
                                 sum(e.nbytes for e in self._entries.values()), len(self._entries))

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def _hold(self, request_id: str, digest: str, entry: _Entry[V]) -> None:
        if request_id in entry.holders:
            return
        if not entry.holders and digest in self._unheld:
            del self._unheld[digest]
            self._unheld_bytes -= entry.nbytes
        entry.holders.add(request_id)
        self._held_by.setdefault(request_id, []).append(digest)

    def _evict(self) -> None:
        while self._unheld_bytes > self.max_bytes:
            digest, _ = self._unheld.popitem(last=False)
            self._unheld_bytes -= self._entries.pop(digest).nbytes
            self._evictions += 1
