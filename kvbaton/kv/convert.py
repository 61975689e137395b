"""Writing KV blocks of another element type into a pool: how prefill and decode workers may differ in
`--kv-cache-dtype` (say bf16 prefill for quality, int8 decode for capacity).

The receiver converts, because only it knows its own pool's format, and the sender's bytes then
stay what every transport already moves and checks (MACs, digests, sizes of the sender's layout):

    sender's rows (its dtype) -> gathered -> fp32 -> the pool's dtype -> scattered into dst blocks

Quantizing here gives the same codes as the decode worker computing the KV itself from the same
values: both quantize each head's row with its own scale (`kvbaton.kernels.kv_quant`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbaton.kernels.kv_quant import dequantize_rows, quantize_rows
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools, torch_dtype
from kvbaton.kv.rows import copy_rows


def largest_block_bytes(layout: KVLayout) -> int:
    """The most bytes one block of one layer may have in a layout that differs from `layout` only in
    dtype (fp32): what a receiver accepts per block from a sender of unknown dtype."""
    return max(layout.block_bytes, layout.with_dtype("float32").block_bytes)


def write_blocks(pools: KVPools, layer: int, dst_block_ids: Sequence[int], src_address: int,
                 src_rows: Sequence[int], src_layout: KVLayout) -> None:
    """Copy block-row `src_rows[i]` (blocks of `src_layout`, at `src_address`) into block `dst_block_ids[i]`
    of `layer`, converting when `src_layout` holds another dtype. The caller has bound-checked both row
    lists; KVLayoutMismatch if the layouts differ in more than the dtype."""
    ours = pools.layout
    if src_layout == ours:
        copy_rows(pools.address(layer), dst_block_ids, src_address, src_rows, ours.block_bytes)
        return
    src_layout.check_transferable(ours)
    n = len(dst_block_ids)
    if n == 0:
        return
    staged = torch.empty((n * src_layout.block_size, *src_layout.slot_shape), dtype=torch_dtype(src_layout))
    copy_rows(staged.data_ptr(), range(n), src_address, src_rows, src_layout.block_bytes)
    converted = convert_slots(staged, src_layout, ours)
    copy_rows(pools.address(layer), dst_block_ids, converted.data_ptr(), range(n), ours.block_bytes)


def convert_slots(slots: torch.Tensor, src: KVLayout, dst: KVLayout) -> torch.Tensor:
    """[slots, *src.slot_shape] of src's dtype -> a contiguous [slots, *dst.slot_shape] of dst's."""
    values = dequantize_rows(slots, torch.float32) if src.quantized else slots.float()
    out = quantize_rows(values, torch_dtype(dst)) if dst.quantized else values.to(torch_dtype(dst))
    return out.contiguous()
