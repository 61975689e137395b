"""Paged attention: K/V live in a slot-addressed pool and are read back through block tables.

A step's tokens arrive flattened, decodes first, then prefill chunks:

    tokens:  | d0 d1 ... d(B-1) | chunk of prefill 0 | chunk of prefill 1 | ...
             |<-- num_decodes ->|<------------ prefill spans ------------->|

Every layer first writes the step's new K/V into their slots (`slot_mapping`), then each
query attends over its request's whole context, gathered from the pool block by block
(a block's K and V for all its tokens are contiguous, so the gather moves large rows).
Block tables and masks are built once per step (`AttentionMetadata`) and shared by layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbaton.kernels import PagedDecodeKernel, PagedPrefillKernel
from kvbaton.kernels.kv_quant import dequantize_rows, is_quantized, quantize_rows


@dataclass(frozen=True)
class PrefillSpan:
    """One request's prefill chunk: queries `[query_start, query_start + query_len)`."""

    query_start: int
    query_len: int
    context_blocks: torch.Tensor | None  # [nb] blocks holding the whole context; None: no prior context (PyTorch path)
    context_len: int
    mask: torch.Tensor | None  # [Lq, L] bool, bottom-right causal; None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step forward context, passed explicitly into `model.forward`."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [B, nb] blocks per decode (padded with block 0)
    decode_context_lens: torch.Tensor | None  # [B] int64
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] additive: 0 attended, -inf not; PyTorch path only
    prefills: tuple[PrefillSpan, ...]
    decode_kernel: PagedDecodeKernel | None = None  # the C kernel; None: batched matmuls
    prefill_kernel: PagedPrefillKernel | None = None  # the C kernel (spans always carry blocks); None: SDPA
    # Called with a layer's index once its K/V are in the pool (layer-wise KV transfer).
    after_layer: Callable[[int], None] | None = None


class PagedAttention(torch.nn.Module):
    """Grouped-query attention over a paged KV pool of shape [num_slots, 2, num_kv_heads, head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H, D]; kv: [T, 2, Hkv, D]; kv_cache: [slots, 2, Hkv, D] (quantized: D + scale bytes)
        stored = quantize_rows(kv, kv_cache.dtype) if is_quantized(kv_cache) else kv.to(kv_cache.dtype)
        kv_cache.index_copy_(0, meta.slot_mapping, stored)
        if not meta.prefills:
            return self._decode(q, kv_cache, meta)
        if not meta.num_decodes and len(meta.prefills) == 1:
            return self._prefill(q, kv, kv_cache, meta.prefills[0], meta.block_size, meta.prefill_kernel)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], kv_cache, meta)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], kv[rows], kv_cache, span, meta.block_size, meta.prefill_kernel)
        return out

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
                dtype: torch.dtype) -> torch.Tensor:
        """[..., nb] block ids -> [..., nb * block_size, 2, Hkv, D] of `dtype` (a quantized pool's rows dequantized:
        the request's context, never the pool)."""
        paged = kv_cache.view(-1, block_size, *kv_cache.shape[1:])  # [N, bs, 2, Hkv, D (+ scale bytes)]
        context = paged[blocks].flatten(-5, -4)
        return dequantize_rows(context, dtype) if is_quantized(kv_cache) else context.to(dtype)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        table, context_lens = meta.decode_block_table, meta.decode_context_lens
        assert table is not None and context_lens is not None, "a step with decodes carries their block table"
        if meta.decode_kernel is not None:
            return meta.decode_kernel(q, kv_cache, table, context_lens, meta.block_size, self.scale)
        assert meta.decode_mask is not None, "the PyTorch decode path needs decode_mask"
        # NOTE: one query per request, so plain batched matmuls beat SDPA's flash kernel;
        # the G query heads sharing a KV head ride along as rows (GQA without repeating K/V).
        batch = q.shape[0]
        context = self._gather(kv_cache, table, meta.block_size, q.dtype)  # [B, L, 2, Hkv, D]
        keys = context[:, :, 0].transpose(1, 2)  # [B, Hkv, L, D]
        values = context[:, :, 1].transpose(1, 2)
        queries = q.view(batch, self.num_kv_heads, self.group, self.head_dim)  # [B, Hkv, G, D]
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(self.scale).add_(meta.decode_mask)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)  # [B, Hkv, G, L]
        return torch.matmul(probs, values).view(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan,
                 block_size: int, kernel: PagedPrefillKernel | None) -> torch.Tensor:
        if kernel is not None:  # causal by position, K/V read from the pool like the decode kernel
            assert span.context_blocks is not None, "with the prefill kernel, spans always carry blocks"
            return kernel(q, kv_cache, span.context_blocks, span.context_len - span.query_len, block_size, self.scale)
        if span.context_blocks is not None:
            kv = self._gather(kv_cache, span.context_blocks, block_size, q.dtype)[: span.context_len]  # [L, 2, Hkv, D]
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [Hkv, L, D]
        # NOTE: with a leading batch dim SDPA takes its fused CPU (flash) kernel, GQA included;
        # 3-D inputs fall to the unfused math path (~5x slower for a 512-token prompt).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=span.mask, is_causal=span.mask is None,
            scale=self.scale, enable_gqa=True,
        )[0]  # [H, Lq, D]
        return out.transpose(0, 1)
