"""Which module implements a checkpoint's architecture (`ModelConfig.architecture`).

Every family's model has the same constructor `(cfg, dtype, max_positions)` and the same
`forward(input_ids, positions, kv_caches, meta, logits_indices)`, so the loader, the runner and
the engine take any of them (`CausalLM`).
"""

from __future__ import annotations

from kvbaton.config import ModelConfig
from kvbaton.models.deepseek import DeepseekV3ForCausalLM
from kvbaton.models.llama import LlamaForCausalLM

CausalLM = LlamaForCausalLM | DeepseekV3ForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM] | type[DeepseekV3ForCausalLM]:
    """The model class for `cfg`: multi-head latent attention (DeepSeek-V3, Kimi-K2) or the Llama family
    (Llama, Mistral, Qwen2/3 and their MoE kin)."""
    return DeepseekV3ForCausalLM if cfg.mla is not None else LlamaForCausalLM
