"""DeepSeek-V3 family decoder (DeepSeek-V3/R1, Kimi-K2): multi-head latent attention over a paged
latent pool (`kvbaton.layers.mla`), dense MLPs in the first `first_k_dense_replace` layers and
sigmoid-routed sparse MoE blocks with a shared expert after them.

Module names are transformers' (`DeepseekV3ForCausalLM`), so checkpoint names map one to one
(the dense and shared MLPs' gate/up and the experts' matrices are fused/stacked at load time as
for the Llama family). `forward` has `LlamaForCausalLM`'s signature: the runner drives either.
"""

from __future__ import annotations

import torch
from torch import nn

from kvbaton.config import ConfigError, MLAConfig, ModelConfig
from kvbaton.layers.attention import AttentionMetadata
from kvbaton.layers.linear import Linear
from kvbaton.layers.mla import LatentAttention
from kvbaton.layers.mlp import MLP
from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.layers.norm import RMSNorm
from kvbaton.layers.rope import RotaryEmbedding, yarn_mscale
from kvbaton.models.decoder import DecoderStack

KVCache = torch.Tensor  # [num_slots, kv_lora_rank + qk_rope_head_dim] per layer: latent and rope key of a token
CosSin = tuple[torch.Tensor, torch.Tensor]


def rotate_interleaved(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb_interleave`: pairs (x0, x1), (x2, x3), ... rotated by one frequency
    each, returned de-interleaved ([evens rotated | odds rotated]); x: [T, heads, D] with
    `RotaryEmbedding.cos_sin`'s tables ([T, 1, D]: cos = [c, c], signed sin = [-s, s])."""
    cos, signed_sin = cos_sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], signed_sin[..., half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def softmax_scale(cfg: ModelConfig, mla: MLAConfig) -> float:
    """`qk_head_dim ** -0.5`, times YaRN's mscale(factor, mscale_all_dim) squared (transformers'
    `yarn_apply_mscale`): the logits grow with the context YaRN stretches RoPE over."""
    scale = mla.qk_head_dim**-0.5
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.mscale_all_dim:
        mscale = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class Attention(nn.Module):
    """transformers' `DeepseekV3Attention`: low-rank q (or a plain q_proj), the latent KV projection and
    its norm, the per-head up-projection `kv_b_proj` (used by `LatentAttention`), `o_proj`."""

    def __init__(self, cfg: ModelConfig, mla: MLAConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.num_heads, self.mla = heads, mla
        q_out = heads * mla.qk_head_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            # NOTE: transformers builds these two norms with its default eps (1e-6), not rms_norm_eps
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.rope = rope
        self.attn = LatentAttention(heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                    mla.v_head_dim, scale=softmax_scale(cfg, mla))

    def _rotate(self, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
        if self.mla.rope_interleave:
            return rotate_interleaved(x, cos_sin)
        x = x.clone()
        self.rope.apply_(x, cos_sin)
        return x

    def forward(self, cos_sin: CosSin, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens, mla = x.shape[0], self.mla
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, mla.qk_head_dim)  # [T, H, nope + rope]
        compressed = self.kv_a_proj_with_mqa(x)  # [T, R + rope]
        c_kv, k_pe = compressed.split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        q_pe = self._rotate(q[..., mla.qk_nope_head_dim:], cos_sin)
        k_pe = self._rotate(k_pe[:, None], cos_sin)[:, 0]
        q = torch.cat((q[..., : mla.qk_nope_head_dim], q_pe), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # [T, R + rope]: the pool's row
        out = self.attn(q, latent, kv_cache, meta, self.kv_b_proj)  # [T, H, v]
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mla: MLAConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, mla, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        self.mlp: MLP | SparseMoeBlock = (SparseMoeBlock(cfg.hidden_size, moe) if moe is not None and
                                          moe.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama family's: the residual adds are fused into the norms."""
        h, residual = self.attend(cos_sin, x, residual, kv_cache, meta)
        return self.mlp(h), residual

    def attend(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its FFN: (the FFN's input, the residual stream); a micro-batched step calls it apart
        from the FFN (`models/ping_pong.py`)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        return self.post_attention_layernorm.add_forward(self.self_attn(cos_sin, h, kv_cache, meta), residual)


class DeepseekV3ForCausalLM(DecoderStack):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        mla = cfg.mla
        if mla is None:
            raise ConfigError(f"{cfg.architecture} config without multi-head latent attention fields (kv_lora_rank)")
        # NOTE: RoPE turns only the decoupled qk_rope_head_dim part of q and k
        rope = RotaryEmbedding(mla.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        super().__init__(cfg, rope, [DecoderLayer(cfg, mla, rope, i) for i in range(cfg.num_hidden_layers)])
