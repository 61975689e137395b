"""Store keys: a block's content address, prefixed by everything that makes its KV bytes differ.

The prefix cache names a block by its chained hash (`kvbaton.kv.hashing`, `cache_salt` already
folded into the chain's root). Across workers that is not enough: the same tokens give other
bytes under another model, layout or dtype. So a store key is

    namespace (NAMESPACE_BYTES) | block hash (HASH_BYTES)

where the namespace digests the model's fingerprint and the KV layout. Nothing in it depends on
the process (no `hash()`, no seed): two workers, on any hosts, agree on every key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbaton.kv.hashing import HASH_BYTES, BlockHash
from kvbaton.kv.layout import KVLayout

NAMESPACE_BYTES = 8
KEY_BYTES = NAMESPACE_BYTES + HASH_BYTES
FORMAT_VERSION = 1  # of the payload (layer after layer of one block's rows); a change makes new keys
_SAMPLES = 16  # chunks of each weight file read for the fingerprint
_SAMPLE_BYTES = 4096


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest of the checkpoint that changes when its weights do, read in milliseconds.

    config.json and every weight file's size and header, plus `_SAMPLES` chunks spread over each
    file: a fine-tune of the same architecture has the same header but other bytes nearly everywhere,
    so its KV never mixes with the base model's. Hashing whole files would cost seconds per GB."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    config = root / "config.json"
    if config.is_file():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")) + sorted(root.glob("*.gguf")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES + 1):
                f.seek(0 if i == 0 else max(0, size * i // (_SAMPLES + 1)))
                digest.update(f.read(_SAMPLE_BYTES if i else 65536))  # the first read covers the header
    return digest.hexdigest()


def layout_digest(layout: KVLayout) -> str:
    """The layout as canonical text: every field that changes a block's bytes."""
    parts = [str(FORMAT_VERSION), str(layout.num_layers), str(layout.block_size), layout.dtype]
    parts += [f"{c.name}:{c.num_heads}x{c.head_dim}" for c in layout.components]
    return ";".join(parts)


@dataclass(frozen=True)
class StoreKeys:
    """Turns block hashes into store keys for one (model, layout)."""

    namespace: bytes

    @classmethod
    def of(cls, fingerprint: str, layout: KVLayout) -> StoreKeys:
        text = f"kvbaton-kv-store\x00{fingerprint}\x00{layout_digest(layout)}".encode()
        return cls(hashlib.blake2b(text, digest_size=NAMESPACE_BYTES).digest())

    def key(self, block_hash: BlockHash) -> bytes:
        if len(block_hash) != HASH_BYTES:
            raise ValueError(f"a block hash has {HASH_BYTES} bytes, not {len(block_hash)}")
        return self.namespace + block_hash

    def keys(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        return [self.key(h) for h in block_hashes]


def key_text(key: bytes) -> str:
    """A key as a file or Redis name: lowercase hex, nothing a path or a command could misread."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a store key has {KEY_BYTES} bytes, not {len(key)}")
    return key.hex()


def safe_arena_name(name: str) -> str:
    """An shm arena name as given by an operator, checked: it becomes a file name under /dev/shm."""
    if not name or len(name) > 200 or not all(c.isalnum() or c in "_.-" for c in name) or name.startswith("."):
        raise ValueError(f"KV store shm name {name!r} must be 1-200 letters, digits, '_', '.' or '-' "
                         "(and not start with '.')")
    return name if name.startswith("kvb-") else f"kvb-store-{name}"
