"""The content address of a KV block: a hash chained from its parent block's hash and its token ids.

Equal hashes mean equal prefixes, in any process on any host: the prefix cache, the router's
prefix-aware policy and (later) the shared KV tiers all name blocks this way. So the bytes
hashed are fixed: token ids as little-endian int64, whatever the host's byte order, and no
per-process seed (Python's `hash()` would give every process its own address space).
No torch here: the scheduler and the router use it.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes

ROOT_HASH = b"kvbaton-root"
HASH_BYTES = 16


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 (array("q") is native-endian: swapped on big-endian hosts)."""
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], images: bytes = b"") -> BlockHash:
    """The hash of a full block of `token_ids` whose prefix ends in the block `parent` (None: the first).
    `images`: the digests of the images whose placeholder tokens the block holds (every image's placeholders
    are the same tokens: without them, two prompts differing only in an image would share KV)."""
    digest = hashlib.blake2b(parent or ROOT_HASH, digest_size=HASH_BYTES)
    digest.update(token_bytes(token_ids))
    if images:
        digest.update(b"\x00images\x00" + images)
    return digest.digest()


def salted_root(salt: str | None) -> BlockHash | None:
    """The parent of a request's first block: None (the shared root) unsalted, else a root of the salt's
    own, so requests with different `cache_salt`s never name a block alike."""
    if salt is None:
        return None
    return hashlib.blake2b(ROOT_HASH + b"\x00salt\x00" + salt.encode(), digest_size=HASH_BYTES).digest()


def chained_block_hashes(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                         start_block: int = 0, num_blocks: int | None = None,
                         images: Callable[[int, int], bytes] | None = None) -> list[BlockHash]:
    """Hashes of the full blocks `start_block .. start_block + num_blocks` of `token_ids` (default: every full
    block from `start_block`), chained from `parent`, the hash of block `start_block - 1`. `images(start, end)`:
    the digests of the images with placeholders in positions [start, end) (`sched.request.digests_between`)."""
    end = len(token_ids) // block_size if num_blocks is None else start_block + num_blocks
    out: list[BlockHash] = []
    for i in range(start_block, end):
        lo, hi = i * block_size, (i + 1) * block_size
        parent = hash_block_tokens(parent, token_ids[lo:hi], images(lo, hi) if images is not None else b"")
        out.append(parent)
    return out
