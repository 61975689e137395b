"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent pool.

Per token the pool keeps, not K and V of every head, but one row shared by all heads
(`KVLayout.mla`):

    slot:  | c_kv [kv_lora_rank] (after kv_a_layernorm) | k_pe [rope_dim] (already rotated) |

Every head's key and value are up-projections of the latent through `kv_b_proj`'s weight
W = [W_UK; W_UV] per head ([H, nope + v, kv_lora_rank]):

    k_h = [W_UK_h c_kv ; k_pe]        v_h = W_UV_h c_kv

Prefill chunks compute attention the plain ("naive") way: up-project the context's latents into
per-head keys and values and run SDPA (causal, or bottom-right causal over prior context), as
`PagedAttention._prefill` does. Decodes use the absorbed form, which never materializes per-head
keys or values: q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, so a query moved into latent
space attends over the latent rows directly, and W_UV is applied once to the attended latent:

    scores_h = [W_UK_h^T q_nope_h ; q_pe_h] . [c ; k_pe]      out_h = W_UV_h (softmax(scores_h) . c)

Both read the same rows, so a block computed by either (or by another worker) serves both.
There are no C kernels for this layout: the PyTorch path only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbaton.layers.attention import AttentionMetadata, PrefillSpan
from kvbaton.layers.linear import Linear


class LatentAttention(torch.nn.Module):
    """Attention of `num_heads` heads over a pool of shape [num_slots, kv_lora_rank + rope_dim]."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_b_proj: Linear) -> torch.Tensor:
        """q: [T, H, nope + rope] (rope part rotated); latent: [T, kv_lora_rank + rope] (c_kv normed, k_pe rotated);
        kv_cache: [slots, kv_lora_rank + rope]; kv_b_proj: the up-projection (its owner's: `self_attn.kv_b_proj`).
        Returns [T, H, v_head_dim]."""
        pool = kv_cache.view(kv_cache.shape[0], -1)
        pool.index_copy_(0, meta.slot_mapping, latent.to(pool.dtype))
        if not meta.prefills:
            return self._decode(q, pool, meta, kv_b_proj)
        if not meta.num_decodes and len(meta.prefills) == 1:
            return self._prefill(q, latent, pool, meta.prefills[0], meta.block_size, kv_b_proj)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], pool, meta, kv_b_proj)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], latent[rows], pool, span, meta.block_size, kv_b_proj)
        return out

    @staticmethod
    def _gather(pool: torch.Tensor, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[..., nb] block ids -> [..., nb * block_size, kv_lora_rank + rope] latent rows of `dtype`."""
        paged = pool.view(-1, block_size, pool.shape[-1])  # [N, bs, R + r]
        return paged[blocks].flatten(-3, -2).to(dtype)

    def _up_weights(self, kv_b_proj: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, R] and W_UV [H, v, R]: views of kv_b_proj's weight (no copies)."""
        w = kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    def _decode(self, q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata,
                kv_b_proj: Linear) -> torch.Tensor:
        table, mask = meta.decode_block_table, meta.decode_mask
        assert table is not None and mask is not None, "MLA decodes take the PyTorch path: table and mask"
        return self.absorbed(q, self._gather(pool, table, meta.block_size, q.dtype), mask[:, 0], kv_b_proj)

    def absorbed(self, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None,
                 kv_b_proj: Linear) -> torch.Tensor:
        """One query per request, absorbed: q [B, H, nope + rope], context [B, L, R + rope] latent rows, mask
        [B, 1, L] additive (or None) -> [B, H, v]."""
        w_uk, w_uv = self._up_weights(kv_b_proj)
        q_nope, q_pe = q.split((self.nope_dim, self.rope_dim), dim=-1)
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, B, nope] @ [H, nope, R]: [B, H, R]
        queries = torch.cat((q_latent, q_pe), dim=-1)  # [B, H, R + rope]: the pool's row layout
        scores = torch.matmul(queries, context.transpose(-1, -2)).mul_(self.scale)  # [B, H, L]
        if mask is not None:
            scores.add_(mask)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out_latent = torch.matmul(probs, context[..., : self.kv_lora_rank])  # [B, H, R]
        return torch.matmul(out_latent.transpose(0, 1), w_uv.transpose(-1, -2)).transpose(0, 1)  # [B, H, v]

    def naive(self, q: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None,
              kv_b_proj: Linear) -> torch.Tensor:
        """q [Lq, H, nope + rope] over context [L, R + rope] latent rows: keys and values up-projected per head,
        then SDPA; mask [Lq, L] bool (True: attended), or None: causal. -> [Lq, H, v]."""
        length = context.shape[0]
        kv = kv_b_proj(context[:, : self.kv_lora_rank]).view(length, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)  # [L, H, nope], [L, H, v]
        k_pe = context[:, None, self.kv_lora_rank:].expand(length, self.num_heads, self.rope_dim)
        k = torch.cat((k_nope, k_pe), dim=-1)  # [L, H, nope + rope]
        # NOTE: a leading batch dim takes SDPA's fused CPU kernel (see PagedAttention._prefill).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            is_causal=mask is None, scale=self.scale,
        )[0]  # [H, Lq, v]
        return out.transpose(0, 1)

    def _prefill(self, q: torch.Tensor, latent: torch.Tensor, pool: torch.Tensor, span: PrefillSpan,
                 block_size: int, kv_b_proj: Linear) -> torch.Tensor:
        if span.context_blocks is None:  # no prior context: the chunk's own rows, plain causal
            return self.naive(q, latent, None, kv_b_proj)
        context = self._gather(pool, span.context_blocks, block_size, q.dtype)[: span.context_len]
        mask = span.mask
        if mask is None and span.context_len > span.query_len:  # a span made for the C prefill kernel: no mask
            first = span.context_len - span.query_len
            mask = torch.arange(span.context_len)[None] <= torch.arange(first, span.context_len)[:, None]
        return self.naive(q, context, mask, kv_b_proj)
