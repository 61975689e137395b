"""`KVLayout` is the one description of a KV pool: shapes and sizes come from it, it survives the
wire unchanged, and two workers that disagree get a message naming every difference."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvbaton.kv.convert import convert_slots
from kvbaton.kv.layout import KVComponent, KVLayout, KVLayoutMismatch
from kvbaton.kv.pools import KVPools, allocate_pools, block_view

STD = KVLayout.standard(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def test_standard_layout_shapes_and_sizes():
    assert STD.slot_shape == (2, 2, 8) and STD.pool_shape(5) == (20, 2, 2, 8)
    assert STD.block_numel == 4 * 2 * 2 * 8 and STD.block_bytes == 2 * STD.block_numel
    assert STD.bytes_per_block == 3 * STD.block_bytes
    assert (STD.num_kv_heads, STD.head_dim) == (2, 8)


def test_components_of_other_shapes_flatten_the_slot():
    # e.g. MLA: a latent and a rope key per token, not per-head K and V
    mla = KVLayout(num_layers=2, block_size=4, dtype="float32",
                   components=(KVComponent("c_kv", 1, 16), KVComponent("k_rope", 1, 8)))
    assert mla.slot_shape == (24,) and mla.pool_shape(3) == (12, 24) and mla.block_bytes == 4 * 24 * 4


def test_mla_layout_is_one_latent_row_per_slot_and_not_quantizable():
    mla = KVLayout.mla(num_layers=2, block_size=4, kv_lora_rank=8, rope_dim=8, dtype="bfloat16")
    assert mla.is_mla and not STD.is_mla and mla.component_names == ("c_kv", "k_rope")
    assert mla.slot_shape == (16,) and mla.block_bytes == 4 * 16 * 2  # flat even when both parts are 8 wide
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(mla), type=KVLayout) == mla
    mla.check_transferable(mla.with_dtype("float32"))
    with pytest.raises(KVLayoutMismatch, match="components c_kv/k_rope vs k/v"):
        mla.check_transferable(STD)
    with pytest.raises(ValueError, match="cannot be quantized"):
        mla.with_dtype("int8")
    # a receiver converts another float dtype slot by slot (kvbaton.kv.convert)
    slots = torch.randn(8, 16)
    out = convert_slots(slots, mla.with_dtype("float32"), mla)
    assert out.dtype == torch.bfloat16 and torch.equal(out, slots.to(torch.bfloat16))


def test_layout_round_trips_through_msgpack():
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(STD), type=KVLayout) == STD


def test_mismatch_names_every_difference():
    other = KVLayout.standard(num_layers=3, block_size=8, num_kv_heads=2, head_dim=16, dtype="float32")
    with pytest.raises(KVLayoutMismatch) as info:
        STD.check_compatible(other)
    message = str(info.value)
    for part in ("block_size 4 vs 8", "dtype bfloat16 vs float32", "k head_dim 8 vs 16", "v head_dim 8 vs 16",
                 "--block-size"):
        assert part in message
    STD.check_compatible(KVLayout.standard(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16"))


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="KV dtype"):
        KVLayout.standard(num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype="int3")
    with pytest.raises(ValueError, match="at least one layer"):
        KVLayout.standard(num_layers=0, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")


def test_pools_are_allocated_from_the_layout_and_checked_against_it():
    pools = allocate_pools(STD, num_blocks=5)
    assert pools.num_blocks == 5 and [c.shape for c in pools.caches] == [torch.Size(STD.pool_shape(5))] * 3
    assert pools.caches[0].dtype == torch.bfloat16 and block_view(pools.caches[0], STD).shape == (5, STD.block_numel)
    with pytest.raises(ValueError, match="not a pool of slots"):
        KVPools(STD, [torch.zeros(20, 2, 2, 4, dtype=torch.bfloat16)] * 3)
    with pytest.raises(ValueError, match="dtype"):
        KVPools(STD, [torch.zeros(STD.pool_shape(5))] * 3)  # float32
    with pytest.raises(ValueError, match="3 layers"):
        KVPools(STD, pools.caches[:2])
