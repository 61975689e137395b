"""Paged attention: K/V live in a slot-addressed pool and are read back through block tables.

A step's tokens arrive flattened, decodes first, then prefill chunks:

    tokens:  | d0 d1 ... d(B-1) | chunk of prefill 0 | chunk of prefill 1 | ...
             |<-- num_decodes ->|<------------ prefill spans ------------->|

Every layer first writes the step's new K/V into their slots (`slot_mapping`), then each
query attends over its request's whole context, gathered from the pool block by block
(whole blocks are contiguous, so the gather moves large rows). Block tables and masks are
built once per step (`AttentionMetadata`) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """One request's prefill chunk: queries `[query_start, query_start + query_len)`."""

    query_start: int
    query_len: int
    context_blocks: torch.Tensor | None  # [nb] blocks holding the whole context; None: no prior context
    context_len: int
    mask: torch.Tensor | None  # [Lq, L] bool, bottom-right causal; None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step forward context, passed explicitly into `model.forward`."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [B, nb] blocks per decode (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool, True where attended
    prefills: tuple[PrefillSpan, ...]


class PagedAttention(torch.nn.Module):
    """Grouped-query attention over a paged KV pool of shape [num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache, meta)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, meta.block_size)
        return out

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
        """[..., nb] block ids -> [..., nb * block_size, Hkv, D] keys or values."""
        paged = cache.view(-1, block_size, self.num_kv_heads, self.head_dim)  # [N, bs, Hkv, D]
        return paged[blocks].flatten(-4, -3)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # NOTE: one query per request, so plain batched matmuls beat SDPA's flash kernel;
        # the G query heads sharing a KV head ride along as rows (GQA without repeating K/V).
        batch = q.shape[0]
        keys = self._gather(k_cache, meta.decode_block_table, meta.block_size).transpose(1, 2)  # [B, Hkv, L, D]
        values = self._gather(v_cache, meta.decode_block_table, meta.block_size).transpose(1, 2)
        queries = q.view(batch, self.num_kv_heads, self.group, self.head_dim)  # [B, Hkv, G, D]
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(self.scale)  # [B, Hkv, G, L]
        scores.masked_fill_(meta.decode_mask.logical_not(), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values).view(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, span: PrefillSpan, block_size: int) -> torch.Tensor:
        if span.context_blocks is not None:
            k = self._gather(k_cache, span.context_blocks, block_size)[: span.context_len]  # [L, Hkv, D]
            v = self._gather(v_cache, span.context_blocks, block_size)[: span.context_len]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=span.mask,
            is_causal=span.mask is None, scale=self.scale, enable_gqa=True,
        )  # [H, Lq, D]
        return out.transpose(0, 1)
