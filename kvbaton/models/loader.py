"""Build a model from an HF checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.models.llama import LlamaForCausalLM

# HF parameter name -> (our fused parameter, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_model(model_dir: str | Path, dtype: torch.dtype, max_positions: int) -> LlamaForCausalLM:
    """Instantiate the model for `model_dir` and fill every parameter from its safetensors."""
    cfg = ModelConfig.from_dir(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in model directory {model_dir}")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, dtype, max_positions)
    model.to_empty(device="cpu")
    # NOTE: buffers (the RoPE table) are not in the checkpoint; rebuild them on the CPU.
    model.rope.build_table()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    loaded = _copy_weights(model, files, dtype)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ConfigError(f"checkpoint {model_dir} lacks weights: {sorted(missing)[:5]}")
    return model.to(dtype).eval().requires_grad_(False)


def _copy_weights(model: LlamaForCausalLM, files: list[Path], dtype: torch.dtype) -> set[str]:
    params = dict(model.named_parameters())
    cfg = model.config
    shard_sizes = {
        "qkv_proj": [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2,
        "gate_up_proj": [cfg.intermediate_size] * 2,
    }
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = hf_name.removeprefix("model.")
                if "rotary_emb" in name:
                    continue
                tensor = f.get_tensor(hf_name)
                target, shard = _resolve(name, shard_sizes)
                if target not in params:
                    continue  # e.g. lm_head.weight of a tied checkpoint is the embedding
                param = params[target]
                with torch.no_grad():
                    if shard is None:
                        param.copy_(tensor.to(param.dtype))
                    else:
                        param.narrow(0, shard[0], shard[1]).copy_(tensor.to(param.dtype))
                loaded.add(target)
    if cfg.tie_word_embeddings and "embed_tokens.weight" in loaded:
        loaded.add("lm_head.weight")
    return loaded


def _resolve(name: str, shard_sizes: dict[str, list[int]]) -> tuple[str, tuple[int, int] | None]:
    """Map an HF name to (our name, (row offset, rows)) for weights we fuse at load time."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, index = _FUSED[part]
            sizes = shard_sizes[fused]
            parts[i] = fused
            return ".".join(parts), (sum(sizes[:index]), sizes[index])
    return name, None
