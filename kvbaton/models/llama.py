"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, and their MoE kin Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE) over a paged KV pool.

Qwen2 differs only by q/k/v biases, Qwen3 by a per-head RMSNorm on q and k, OLMoE by an RMSNorm over all
of q (and of k) and an optional clamp; the MoE families swap the dense MLP for a sparse MoE block in their
MoE layers. One readable module covers them all, switched by `ModelConfig` fields.
"""

from __future__ import annotations

import torch
from torch import nn

from kvbaton.config import ModelConfig
from kvbaton.layers.attention import AttentionMetadata, PagedAttention
from kvbaton.layers.linear import Linear
from kvbaton.layers.mlp import MLP
from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.layers.norm import RMSNorm
from kvbaton.layers.rope import RotaryEmbedding
from kvbaton.models.decoder import DecoderStack

KVCache = torch.Tensor  # [num_slots, 2, Hkv, D] per layer: K and V of a token side by side
CosSin = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # NOTE: q, k and v share one matmul (weights concatenated at load time).
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.per_head_norm = cfg.qk_norm_per_head
        q_dim, k_dim = (self.head_dim, self.head_dim) if cfg.qk_norm_per_head else (self.q_size, self.kv_size)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.rope = rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, cos_sin: CosSin, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        flat = self.qkv_proj(x)  # [T, (H + 2Hkv) * D]
        if self.q_norm is not None and self.k_norm is not None and not self.per_head_norm:
            q, k = slice(0, self.q_size), slice(self.q_size, self.q_size + self.kv_size)
            flat[:, q], flat[:, k] = self.q_norm(flat[:, q]), self.k_norm(flat[:, k])
        if self.clip_qkv is not None:
            flat.clamp_(-self.clip_qkv, self.clip_qkv)
        qkv = flat.view(tokens, heads + 2 * self.num_kv_heads, self.head_dim)  # [T, H + 2Hkv, D]
        if self.q_norm is not None and self.k_norm is not None and self.per_head_norm:
            kernel = self.q_norm.heads  # the C per-head norm where the plan chose the C norms
            if kernel is not None and kernel.handles(flat, self.q_norm.weight):  # in place, as the C loop does
                kernel(flat, 0, heads, self.q_norm.weight, self.q_norm.eps)
                kernel(flat, heads, self.num_kv_heads, self.k_norm.weight, self.k_norm.eps)
            else:
                qkv[:, :heads] = self.q_norm(qkv[:, :heads])
                qkv[:, heads:heads + self.num_kv_heads] = self.k_norm(qkv[:, heads:heads + self.num_kv_heads])
        self.rope.apply_(qkv[:, :heads + self.num_kv_heads], cos_sin)  # q and k heads in one go
        q = qkv[:, :heads]  # [T, H, D]
        kv = qkv[:, heads:].unflatten(1, (2, self.num_kv_heads))  # [T, 2, Hkv, D]
        out = self.attn(q, kv, kv_cache, meta)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.is_moe_layer(index)
        self.mlp: MLP | SparseMoeBlock = (SparseMoeBlock(cfg.hidden_size, cfg.moe) if sparse and cfg.moe
                                          else MLP(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the adds are fused
        into the norms); returns this layer's output and the residual stream before it."""
        h, residual = self.attend(cos_sin, x, residual, kv_cache, meta)
        return self.mlp(h), residual

    def attend(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its FFN: (the FFN's input, the residual stream); a micro-batched step calls it apart
        from the FFN (`models/ping_pong.py`)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        return self.post_attention_layernorm.add_forward(self.self_attn(cos_sin, h, kv_cache, meta), residual)


class LlamaForCausalLM(DecoderStack):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype,
                               mrope_section=cfg.vision.mrope_section if cfg.vision is not None else ())
        super().__init__(cfg, rope, [DecoderLayer(cfg, rope, i) for i in range(cfg.num_hidden_layers)])
