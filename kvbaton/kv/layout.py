"""What a KV block is, byte for byte: the one description of a pool's shape, so two workers can
check they agree before a transfer, and the engine, the transports and the attention backend
never spell the shape out themselves.

A pool holds, per token slot, the layout's `components` side by side, in order:

    standard attention:  k [Hkv, D] | v [Hkv, D]                  -> slot shape [2, Hkv, D]
    quantized (int8, fp8_e4m3): every head's row is D one-byte codes and its fp32 scale
                         k [Hkv, D + 4] | v [Hkv, D + 4]           -> slot shape [2, Hkv, D + 4] bytes
    MLA (DeepSeek-V3):   c_kv [1, kv_lora_rank] | k_rope [1, rope_dim]  -> slot shape [kv_lora_rank + rope_dim]
                         (the latent every head's K and V are up-projected from, and the one shared RoPE key;
                         not quantizable: a quantized row is per head of K or V)

One layer's pool is `pool_shape(num_blocks)` = `[num_blocks * block_size, *slot_shape]`, with
`slot = block * block_size + offset`, so one block of one layer is a contiguous run of
`block_numel` elements: the unit every transport moves (`KVPools.blocks(layer)[block_id]`).
"""

from __future__ import annotations

import msgspec
import msgspec.structs

# NOTE: no torch here: the scheduler and the router carry layouts; tensors of a layout are `pools.py`'s.
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2, "int8": 1, "fp8_e4m3": 1}
# NOTE: a quantized row keeps its scale beside its codes (per token, per head), so a block of one layer stays one
# contiguous run of bytes that every transport and tier moves unchanged, scales included.
QUANTIZED = ("int8", "fp8_e4m3")
SCALE_BYTES = 4  # an fp32 scale after each head's codes
K, V = "k", "v"
C_KV, K_ROPE = "c_kv", "k_rope"


class KVLayoutMismatch(ValueError):
    """Prefill and decode workers disagree on the KV layout; the transfer is refused."""


class KVComponent(msgspec.Struct, frozen=True):
    """One tensor cached for every token: `[num_heads, head_dim]` elements of the layout's dtype."""

    name: str
    num_heads: int
    head_dim: int

    @property
    def numel(self) -> int:
        return self.num_heads * self.head_dim


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    num_layers: int
    block_size: int
    dtype: str  # a key of ELEMENT_BYTES
    components: tuple[KVComponent, ...]

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"KV dtype must be one of {', '.join(ELEMENT_BYTES)}, not {self.dtype!r}")
        if min(self.num_layers, self.block_size, len(self.components)) < 1:
            raise ValueError("a KV layout needs at least one layer, one slot per block and one component")
        if self.is_mla and self.quantized:
            raise ValueError(f"an MLA KV layout (latent c_kv + rope key) cannot be quantized ({self.dtype}): "
                             "its rows are not per head of K or V; use a float KV dtype")

    @classmethod
    def standard(cls, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str) -> KVLayout:
        """K and V of every KV head, side by side per slot: `[slots, 2, Hkv, D]`."""
        return cls(num_layers=num_layers, block_size=block_size, dtype=dtype,
                   components=(KVComponent(K, num_kv_heads, head_dim), KVComponent(V, num_kv_heads, head_dim)))

    @classmethod
    def mla(cls, *, num_layers: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: str) -> KVLayout:
        """Multi-head latent attention: per slot the compressed latent `c_kv` and the shared RoPE key, flattened
        `[slots, kv_lora_rank + rope_dim]`. Quantized dtypes are refused (their rows are per head of K or V)."""
        return cls(num_layers=num_layers, block_size=block_size, dtype=dtype,
                   components=(KVComponent(C_KV, 1, kv_lora_rank), KVComponent(K_ROPE, 1, rope_dim)))

    # ---- shape -----------------------------------------------------------------------------

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED

    @property
    def row_numel(self) -> int:
        """Elements stored per head and token beyond `head_dim`: a quantized row's scale bytes."""
        return SCALE_BYTES if self.quantized else 0

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """One slot's shape: `[num_components, heads, dim (+ scale bytes)]` when every component has the same
        shape (K and V), else (MLA's latent and rope key always) the components' elements flattened."""
        first = self.components[0]
        same = all((c.num_heads, c.head_dim) == (first.num_heads, first.head_dim) for c in self.components)
        if same and not self.is_mla:
            return (len(self.components), first.num_heads, first.head_dim + self.row_numel)
        return (self.slot_numel,)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's pool for `num_blocks` blocks."""
        return (num_blocks * self.block_size, *self.slot_shape)

    @property
    def slot_numel(self) -> int:
        return sum(c.num_heads * (c.head_dim + self.row_numel) for c in self.components)

    @property
    def block_numel(self) -> int:
        """Elements of one block in one layer (every component)."""
        return self.block_size * self.slot_numel

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return self.block_numel * self.element_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer: what the pool's memory budget is divided by."""
        return self.num_layers * self.block_bytes

    # ---- components --------------------------------------------------------------------------

    def component(self, name: str) -> KVComponent:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"this KV layout has no component {name!r} ({', '.join(self.component_names)})")

    @property
    def component_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    @property
    def is_mla(self) -> bool:
        """The latent layout of multi-head latent attention (no per-head K and V)."""
        return self.component_names == (C_KV, K_ROPE)

    @property
    def num_kv_heads(self) -> int:
        return self.component(K).num_heads

    @property
    def head_dim(self) -> int:
        return self.component(K).head_dim

    # ---- agreement between workers -----------------------------------------------------------

    def with_dtype(self, dtype: str) -> KVLayout:
        return msgspec.structs.replace(self, dtype=dtype)

    def check_compatible(self, other: KVLayout) -> None:
        """Byte-identical blocks, or KVLayoutMismatch: for transports that write into the peer's pool
        themselves (mooncake), where nobody could convert."""
        self._check(other, ("num_layers", "block_size", "dtype"), "the same model, --kv-cache-dtype and --block-size")

    def check_transferable(self, other: KVLayout) -> None:
        """The same blocks up to the element type, or KVLayoutMismatch: a receiver converts another KV
        dtype as it writes its pool (`kvbaton.kv.convert`), so prefill and decode may differ in it."""
        self._check(other, ("num_layers", "block_size"), "the same model and --block-size")

    def _check(self, other: KVLayout, fields: tuple[str, ...], advice: str) -> None:
        diffs = [f"{name} {getattr(self, name)} vs {getattr(other, name)}"
                 for name in fields if getattr(self, name) != getattr(other, name)]
        diffs += _component_diffs(self.components, other.components)
        if diffs:
            raise KVLayoutMismatch("KV layout mismatch between prefill and decode workers: " + ", ".join(diffs)
                                   + f" (start both pools with {advice})")


def _component_diffs(ours: tuple[KVComponent, ...], theirs: tuple[KVComponent, ...]) -> list[str]:
    if tuple(c.name for c in ours) != tuple(c.name for c in theirs):
        return [f"components {'/'.join(c.name for c in ours)} vs {'/'.join(c.name for c in theirs)}"]
    return [f"{a.name} {name} {getattr(a, name)} vs {getattr(b, name)}"
            for a, b in zip(ours, theirs) for name in ("num_heads", "head_dim") if getattr(a, name) != getattr(b, name)]
