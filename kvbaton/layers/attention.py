"""Paged attention: K/V live in a slot-addressed pool and are read back through block tables.

A step's tokens arrive flattened, decodes first, then prefill chunks:

    tokens:  | d0 d1 ... d(B-1) | chunk of prefill 0 | chunk of prefill 1 | ...
             |<-- num_decodes ->|<------------ prefill spans ------------->|

Every layer first writes the step's new K/V into their slots (`slot_mapping`), then each
query attends over its request's whole context, gathered from the pool by slot indices.
The indices and masks are built once per step (`AttentionMetadata`) and shared by layers.
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
    context_slots: torch.Tensor | None  # [L] slots of the whole context; None: no prior context
    mask: torch.Tensor | None  # [Lq, L] bool, bottom-right causal; None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step forward context, passed explicitly into `model.forward`."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B, Lmax] context slots per decode (padded with 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool, True where attended
    prefills: tuple[PrefillSpan, ...]


class PagedAttention(torch.nn.Module):
    """Grouped-query attention over a paged KV pool of shape [num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
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
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, Lmax, D]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
        )  # [B, H, 1, D]
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        if span.context_slots is not None:
            k, v = k_cache[span.context_slots], v_cache[span.context_slots]  # [L, Hkv, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=span.mask,
            is_causal=span.mask is None, scale=self.scale, enable_gqa=True,
        )  # [H, Lq, D]
        return out.transpose(0, 1)
