"""What a KV block is, byte for byte, so two workers can check they agree before a transfer.

One layer's pool is `[num_slots, 2, Hkv, D]` with `slot = block * block_size + offset`, so one
block of one layer is a contiguous run of `block_size * 2 * Hkv * D` elements: the unit every
transport moves (`pool.view(num_blocks, -1)[block_id]`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

# NOTE: no torch import at module level: the scheduler (which imports no torch) carries layouts.
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}


class KVLayoutMismatch(ValueError):
    """Prefill and decode workers disagree on the KV layout; the transfer is refused."""


class KVLayout(msgspec.Struct, frozen=True):
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], block_size: int) -> KVLayout:
        _, two, num_kv_heads, head_dim = kv_caches[0].shape
        assert two == 2, "pool layout is [slots, 2, Hkv, D]"
        dtype = str(kv_caches[0].dtype).removeprefix("torch.")
        return cls(len(kv_caches), block_size, num_kv_heads, head_dim, dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def block_numel(self) -> int:
        """Elements of one block in one layer (K and V)."""
        return self.block_size * 2 * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * ELEMENT_BYTES[self.dtype]

    def check_compatible(self, other: KVLayout) -> None:
        if self == other:
            return
        diffs = [f"{name} {getattr(self, name)} vs {getattr(other, name)}"
                 for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
                 if getattr(self, name) != getattr(other, name)]
        raise KVLayoutMismatch("KV layout mismatch between prefill and decode workers: " + ", ".join(diffs)
                               + " (start both pools with the same model, --dtype and --block-size)")


def block_view(kv_cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """One layer's pool as [num_blocks, block_numel]: row b is block b, contiguous."""
    return kv_cache.view(-1, layout.block_numel)
