"""Build a model from an HF checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.models.families import CausalLM, model_class

# HF parameter name -> (our fused parameter, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Mixtral's names for an expert's matrices
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# module names some families spell differently from the ones our modules use
_RENAMED = {"block_sparse_moe": "mlp", "shared_expert": "shared_experts"}

# (our parameter's name, the part of it this tensor fills (None: all), whether it is one expert's part)
Target = tuple[str, Callable[[torch.Tensor], torch.Tensor] | None, bool]


def load_model(model_dir: str | Path, dtype: torch.dtype, max_positions: int) -> CausalLM:
    """Instantiate the model for `model_dir` and fill every parameter from its safetensors."""
    cfg = ModelConfig.from_dir(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in model directory {model_dir}")
    # NOTE: built in `dtype` from the start: an fp32 model cast at the end staged a bf16 checkpoint through twice
    # its size (~2 s of a worker's start for the default model)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(cfg)(cfg, dtype, max_positions)
    _materialize(model)
    # NOTE: buffers (the RoPE table, the MoE token counters) are not in the checkpoint; rebuild them on the CPU.
    model.rope.build_table()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.take_token_counts()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    loaded = _copy_weights(model, files, dtype)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ConfigError(f"checkpoint {model_dir} lacks weights: {sorted(missing)[:5]}")
    return model.to(dtype).eval().requires_grad_(False)


def _materialize(model: nn.Module) -> None:
    """Give every meta parameter and buffer uninitialised CPU memory (what `to_empty` does, without its
    `empty_like` over meta tensors: that runs a Python reference that imports sympy, ~0.8 s of a start).
    Tensors shared between modules stay shared."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in params:
                    params[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
                module._parameters[name] = params[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                buffers.setdefault(id(buffer), torch.empty(buffer.shape, dtype=buffer.dtype))
                module._buffers[name] = buffers[id(buffer)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _copy_weights(model: CausalLM, files: list[Path], dtype: torch.dtype) -> set[str]:
    params = dict(model.named_parameters())
    cfg = model.config
    qkv_sizes = [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2
    loaded: set[str] = set()
    filled: dict[str, int] = {}  # stacked expert tensors: how many parts of each were copied
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = text_weight_name(hf_name)
                if name is None or "rotary_emb" in name:
                    continue
                # NOTE: a name that already is ours goes as it is (DeepSeek's q_proj is no fused qkv_proj)
                target, part, stacked = (name, None, False) if name in params else _resolve(name, qkv_sizes)
                if target not in params:
                    continue  # e.g. lm_head.weight of a tied checkpoint is the embedding
                param = params[target]
                tensor = f.get_tensor(hf_name)
                if tensor.dtype in _FLOAT8:  # quantized weights need their scales: never cast them as they are
                    raise ConfigError(f"checkpoint {file.name} holds {tensor.dtype} weights ({hf_name}); quantized "
                                      "checkpoints are not supported: convert the weights to bf16 or fp32 first")
                with torch.no_grad():
                    (param if part is None else part(param)).copy_(tensor.to(param.dtype))
                if stacked:
                    filled[target] = filled.get(target, 0) + 1
                else:
                    loaded.add(target)
    for target, count in filled.items():
        # NOTE: a stacked expert tensor is whole once every expert's parts arrived (gate_up: two each)
        if count == params[target].shape[0] * (2 if target.endswith("gate_up_proj") else 1):
            loaded.add(target)
    if cfg.tie_word_embeddings and "embed_tokens.weight" in loaded:
        loaded.add("lm_head.weight")
    return loaded


# a vision-language checkpoint's weights that are not its text model's (`mm/` loads them)
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "vision_model.", "connector.", "visual.")


def text_weight_name(hf_name: str) -> str | None:
    """The text model's name for a checkpoint weight (`layers.0.mlp.up_proj.weight`, `lm_head.weight`), None for
    a weight of a vision-language checkpoint's encoder. A vision-language checkpoint nests its text model:
    LLaVA's as `language_model.model.*` and `language_model.lm_head.*`, transformers 5's as
    `model.language_model.*` beside a top-level `lm_head.*`; Idefics3's (SmolVLM's) as `model.text_model.*`."""
    name = hf_name.removeprefix("model.")
    if name.startswith(_NOT_TEXT):
        return None
    return name.removeprefix("language_model.").removeprefix("text_model.").removeprefix("model.")


def _resolve(name: str, qkv_sizes: list[int]) -> Target:
    """Map an HF name to our name and the slice of our parameter it fills (fused or stacked weights)."""
    parts = [_RENAMED.get(p, p) for p in name.split(".")]
    if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
        return _expert_target(parts)
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, index = _FUSED[part]
            parts[i] = fused
            if fused == "qkv_proj":
                return ".".join(parts), functools.partial(_rows, qkv_sizes[:index], qkv_sizes[index]), False
            return ".".join(parts), functools.partial(_half, index), False
    return ".".join(parts), None, False


def _rows(before: list[int], rows: int, param: torch.Tensor) -> torch.Tensor:
    return param.narrow(0, sum(before), rows)


def _half(index: int, param: torch.Tensor) -> torch.Tensor:
    """Gate (0) or up (1): the halves of a fused gate_up_proj's rows."""
    return param.narrow(0, index * (param.shape[0] // 2), param.shape[0] // 2)


def _expert_target(parts: list[str]) -> Target:
    """`...experts.<e>.<gate|up|down>_proj.weight` -> a slice of the layer's stacked `experts.gate_up_proj`
    [E, 2I, H] or `experts.down_proj` [E, H, I]."""
    at = parts.index("experts")
    expert, proj = int(parts[at + 1]), _MIXTRAL_EXPERT.get(parts[at + 2], parts[at + 2])
    prefix = ".".join(parts[:at + 1])
    if proj == "down_proj":
        return f"{prefix}.down_proj", lambda p: p[expert], True
    half = 0 if proj == "gate_proj" else 1
    return f"{prefix}.gate_up_proj", lambda p: p[expert].narrow(0, half * (p.shape[1] // 2), p.shape[1] // 2), True


def read_experts(model_dir: str | Path, layer: int, experts: list[int], dtype: torch.dtype,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts `experts` (in that order; repeats allowed) of MoE layer `layer`, stacked as the model
    holds them (gate_up [n, 2I, H], down [n, H, I]), read from the checkpoint: the weight copies of an expert
    rebalancing that moves an expert onto a rank that does not hold it."""
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.moe is None:
        raise ConfigError(f"{model_dir} has no sparse experts")
    size, hidden = cfg.moe.intermediate_size, cfg.hidden_size
    gate_up = torch.empty(len(experts), 2 * size, hidden, dtype=dtype)
    down = torch.empty(len(experts), hidden, size, dtype=dtype)
    rows = {e: [i for i, x in enumerate(experts) if x == e] for e in set(experts)}
    found = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                parts = [_RENAMED.get(p, p) for p in hf_name.removeprefix("model.").split(".")]
                if parts[:3] != ["layers", str(layer), "mlp"] or len(parts) < 7 or parts[3] != "experts":
                    continue
                expert, proj = int(parts[4]), _MIXTRAL_EXPERT.get(parts[5], parts[5])
                for i in rows.get(expert, ()):
                    target = down[i] if proj == "down_proj" else gate_up[i, (proj == "up_proj") * size:][:size]
                    target.copy_(f.get_tensor(hf_name).to(dtype))
                    found += 1
    if found != 3 * len(experts):
        raise ConfigError(f"checkpoint {model_dir} lacks some of experts {sorted(rows)} of layer {layer}")
    return gate_up, down
