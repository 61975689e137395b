"""Convert a GGUF file into an HF-style checkpoint directory (config, safetensors, tokenizer).

Weights are dequantized with the `gguf` package; the tokenizer and chat template are
rebuilt by `transformers` from the GGUF metadata. The result loads like any HF directory.

Sparse-expert GGUFs follow llama.cpp's converter (`convert_hf_to_gguf.py`): arch `llama` with
`llama.expert_count` is Mixtral, `qwen2moe` Qwen1.5/2-MoE, `qwen3moe` Qwen3-MoE, `olmoe` OLMoE. Their experts are
stacked 3-D tensors (`blk.N.ffn_{gate,up,down}_exps`, [E, I, H] / [E, H, I]); they are written back as the
per-expert tensors transformers saves, so the directory also loads in transformers and `read_experts` finds them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvbaton.config import ConfigError

if TYPE_CHECKING:
    from gguf import GGUFReader

# GGUF architecture -> (HF architecture class, model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")  # GGUF arch "llama" with experts
_MOE_ONLY = ("qwen2moe", "qwen3moe", "olmoe")  # architectures that always have experts
# Whether top-k router weights are renormalized when no `{arch}.expert_weights_norm` says so: llama.cpp's own
# choice per arch (the `norm_w` argument of build_moe_ffn in src/models/{llama,qwen2moe,qwen3moe,olmoe}.cpp).
_NORM_TOPK_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
_SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # split into q_proj, k_proj, v_proj
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROUTER = "ffn_gate_inp"
_SHARED_NAMES = {  # Qwen2-MoE's gated shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
# stacked GGUF expert tensor -> the per-expert HF names (mlp.experts.<e>.X / Mixtral's block_sparse_moe.experts.<e>.X)
_EXPERT_PROJ = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                "ffn_down_exps": ("down_proj", "w2")}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SHARD_BYTES = 2 << 30  # start a new safetensors file past this many bytes
# a GGUF tensor type -> the dtype its values are stored in exactly (quantized types: bfloat16)
_STORAGE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class _MoE:
    """The sparse-expert layout of a GGUF, read from its metadata and checked against its tensors."""

    family: str  # HF model_type: mixtral | qwen2_moe | qwen3_moe | olmoe
    num_experts: int
    top_k: int
    expert_size: int  # intermediate size of one routed expert
    shared_size: int  # of the shared expert (0: none)
    dense_layers: tuple[int, ...]  # layers with a dense MLP instead of experts
    dense_size: int | None  # their intermediate size
    norm_topk_prob: bool


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                 tokenizer_dir: str | Path | None = None) -> Path:
    """Write `out_dir` with config.json, *.safetensors and the tokenizer; returns it.

    Weights are stored in `dtype`, or (None) each in its GGUF precision: F32, F16 and BF16 tensors as they
    are, quantized ones dequantized to bfloat16. The tokenizer is rebuilt from the GGUF's metadata, or taken
    from `tokenizer_dir` when given (a directory transformers' AutoTokenizer loads)."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file not found: {gguf_path}")
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises bare ValueErrors on malformed files
        raise ConfigError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    for key in ("block_count", "embedding_length", "attention.head_count"):
        if not isinstance(_field(reader, f"{arch}.{key}"), int):
            raise ConfigError(f"{gguf_path} lacks {arch}.{key}")
    # NOTE: GGUF lists dimensions innermost first (ggml's ne); numpy's order is the reverse.
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ConfigError(f"{gguf_path} has no token_embd.weight tensor")
    moe = _moe_layout(reader, arch, shapes)
    config = _hf_config(reader, arch, shapes, moe)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        _save_tokenizer(gguf_path, out_dir)
    else:
        _copy_tokenizer(Path(tokenizer_dir), out_dir)
    config["torch_dtype"] = _write_tensors(_hf_tensors(reader, arch, moe, dtype), out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):
        # NOTE: GGUF floats are float32; the shortest decimal that reads back as the same float32 is what the
        # HF config held (1e-05, not 9.999999747378752e-06)
        return float(str(np.float32(value)))
    return value


# ---- tensors ---------------------------------------------------------------------------


def _hf_tensors(reader: GGUFReader, arch: str, moe: _MoE | None, dtype: torch.dtype | None,
                ) -> Iterator[tuple[str, np.ndarray, torch.dtype]]:
    """(HF name, float32 array, the dtype to store it in) for every GGUF tensor kvbaton uses, in file order;
    experts split per expert."""
    from gguf.quants import dequantize

    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    key_dim = _field(reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.embedding_length") // heads)
    value_dim = _field(reader, f"{arch}.attention.value_length", key_dim)
    qkv_rows = (heads * key_dim, kv_heads * key_dim, kv_heads * value_dim)
    mixtral = moe is not None and moe.family == "mixtral"
    # NOTE: disable=None is tqdm's own TTY check: a bar on a terminal, nothing in logs, CI or test output.
    for t in tqdm(reader.tensors, desc="kvbaton: converting GGUF", unit="tensor", disable=None, leave=False):
        parts = t.name.split(".")  # blk.N.ffn_gate_exps.weight
        layer_name = parts[2] if len(parts) == 4 and parts[0] == "blk" else None
        name = _hf_name(t.name, mixtral)
        if name is None and layer_name not in _EXPERT_NAMES:
            continue
        try:
            data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ConfigError(f"GGUF tensor {t.name} is of type {t.tensor_type.name}, which the gguf package "
                              f"cannot dequantize: {exc}") from exc
        store = dtype or _STORAGE_DTYPES.get(t.tensor_type.name, torch.bfloat16)
        if layer_name in _EXPERT_NAMES:
            for expert_name, expert in _split_experts(data, parts[1], layer_name, mixtral):
                yield expert_name, expert, store
            continue
        assert name is not None
        if layer_name == "attn_qkv":  # llama.cpp's --fuse-qkv: q, k and v rows concatenated
            if data.shape[0] != sum(qkv_rows):
                raise ConfigError(f"GGUF tensor {t.name} has {data.shape[0]} rows, not q+k+v = {sum(qkv_rows)}")
            # NOTE: copies, not views: safetensors refuses tensors that share memory
            q, k, v = (part.copy() for part in np.split(data, np.cumsum(qkv_rows[:2])))
            split = {"q_proj": q, "k_proj": k, "v_proj": v}
        else:
            split = {name: data}
        for part_name, part in split.items():
            if layer_name == "attn_qkv":
                part_name = name.replace("qkv_proj", part_name)
            if arch == "llama" and part_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                # llama.cpp's converter permutes q/k rows for its RoPE; undo it for HF's layout.
                part = _unpermute(part, heads if "q_proj" in part_name else kv_heads)
            if layer_name == "ffn_gate_inp_shexp":
                part = part.reshape(1, -1)  # HF: a [1, H] linear layer; GGUF may hold it as [H]
            yield part_name, part, store


def _hf_name(gguf_name: str, mixtral: bool = False) -> str | None:
    """The HF name of a GGUF tensor that maps one-to-one (None: a stacked expert tensor or an unknown name)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        return None
    if parts[2] == _ROUTER:
        return f"model.layers.{parts[1]}.{'block_sparse_moe' if mixtral else 'mlp'}.gate.{parts[3]}"
    hf = _LAYER_NAMES.get(parts[2]) or _SHARED_NAMES.get(parts[2])
    return None if hf is None else f"model.layers.{parts[1]}.{hf}.{parts[3]}"


def _split_experts(data: np.ndarray, layer: str, kind: str, mixtral: bool) -> Iterator[tuple[str, np.ndarray]]:
    """A stacked [E, rows, cols] expert tensor as the E per-expert tensors transformers saves."""
    if kind == "ffn_gate_up_exps":  # llama.cpp's --fuse-gate-up-exps: gate rows, then up rows
        half = data.shape[1] // 2
        yield from _split_experts(data[:, :half], layer, "ffn_gate_exps", mixtral)
        yield from _split_experts(data[:, half:], layer, "ffn_up_exps", mixtral)
        return
    proj, mixtral_proj = _EXPERT_PROJ[kind]
    prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts"
    for e in range(data.shape[0]):
        # NOTE: a copy, not a view: safetensors refuses tensors that share memory
        yield f"{prefix}.{e}.{mixtral_proj if mixtral else proj}.weight", data[e].copy()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tensors(tensors: Iterator[tuple[str, np.ndarray, torch.dtype]], out_dir: Path) -> str:
    """Save as model.safetensors, or as shards of about `_SHARD_BYTES` with an index when larger, so that a
    large model never has to be held in memory whole. Returns the name of the dtype most bytes are stored in."""
    shards: list[dict[str, str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0
    dtype_bytes: Counter[str] = Counter()

    def flush() -> None:
        nonlocal pending, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(pending, str(out_dir / name), metadata={"format": "pt"})
        shards.append(dict.fromkeys(pending, name))
        pending, size = {}, 0

    for name, data, dtype in tensors:
        pending[name] = torch.from_numpy(data).to(dtype)
        size += pending[name].nbytes
        dtype_bytes[str(dtype).removeprefix("torch.")] += pending[name].nbytes
        if size >= _SHARD_BYTES:
            flush()
    if pending or not shards:
        flush()
    if len(shards) == 1:
        (out_dir / "model-00001.safetensors").rename(out_dir / "model.safetensors")
    else:
        weight_map = {k: v for shard in shards for k, v in shard.items()}
        index = {"metadata": {}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dtype_bytes.most_common(1)[0][0] if dtype_bytes else "bfloat16"


# ---- config ----------------------------------------------------------------------------


def _moe_layout(reader: GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]]) -> _MoE | None:
    """The experts of a sparse GGUF (None: a dense one); a ConfigError for a variant kvbaton cannot serve."""
    n_experts = _field(reader, f"{arch}.expert_count", 0) or 0
    has_router = any(name.split(".")[2:3] == [_ROUTER] for name in shapes)
    if arch not in _MOE_ONLY and not n_experts and not has_router:
        return None
    family = "mixtral" if arch == "llama" else _ARCHITECTURES[arch][1]
    if arch not in _NORM_TOPK_DEFAULT:
        raise ConfigError(f"sparse experts in a GGUF of architecture {arch!r} are not supported")
    top_k = _field(reader, f"{arch}.expert_used_count", 0) or 0
    if not n_experts or not top_k:
        raise ConfigError(f"this {arch} GGUF lacks {arch}.expert_count or {arch}.expert_used_count")
    _check_moe_metadata(reader, arch)

    blocks = _field(reader, f"{arch}.block_count")
    allowed = {*_LAYER_NAMES, _ROUTER, *_EXPERT_NAMES, *(_SHARED_NAMES if arch == "qwen2moe" else ())}
    for name in shapes:
        parts = name.split(".")
        known = name in _GLOBAL_NAMES or (len(parts) == 4 and parts[0] == "blk" and parts[2] in allowed)
        if not known:
            raise ConfigError(f"{arch} GGUF tensor {name!r} has no counterpart in the {family} HF model "
                              f"(an unsupported variant)")
    expert_sizes: set[int] = set()
    shared_sizes: set[int] = set()
    dense_sizes: set[int] = set()
    dense: list[int] = []
    for i in range(blocks):
        layer = {kind: shapes[name] for kind in (*_LAYER_NAMES, _ROUTER, *_EXPERT_NAMES, *_SHARED_NAMES)
                 if (name := f"blk.{i}.{kind}.weight") in shapes}
        if _ROUTER not in layer:
            if arch not in ("qwen2moe", "qwen3moe") or "ffn_gate" not in layer:
                raise ConfigError(f"{arch} GGUF layer {i} has no expert router ({_ROUTER}); "
                                  f"dense layers are supported only in qwen2moe/qwen3moe GGUFs")
            dense.append(i)
            dense_sizes.add(layer["ffn_gate"][0])
            continue
        if "ffn_gate" in layer:
            raise ConfigError(f"{arch} GGUF layer {i} has both experts and a dense MLP (ffn_gate)")
        router, down = layer[_ROUTER], layer.get("ffn_down_exps")
        gate, up = layer.get("ffn_gate_exps"), layer.get("ffn_up_exps")
        if (fused := layer.get("ffn_gate_up_exps")) is not None and len(fused) == 3:
            gate = up = (fused[0], fused[1] // 2, fused[2])
        if gate is None or up is None or down is None:
            raise ConfigError(f"{arch} GGUF layer {i} lacks gated experts (ffn_gate_exps, ffn_up_exps, "
                              f"ffn_down_exps); ungated experts are not supported")
        if len(gate) != 3 or gate != up or router != (n_experts, gate[2]) or down != (n_experts, gate[2], gate[1]):
            raise ConfigError(f"{arch} GGUF layer {i}: expert tensors {gate}, {down} and router {router} do not "
                              f"match {arch}.expert_count={n_experts}")
        expert_sizes.add(gate[1])
        if "ffn_gate_shexp" in layer and "ffn_gate_inp_shexp" not in layer:
            raise ConfigError(f"{arch} GGUF layer {i} has a shared expert without its gate (ffn_gate_inp_shexp)")
        shared_sizes.add(layer["ffn_gate_shexp"][0] if "ffn_gate_shexp" in layer else 0)
    if len(expert_sizes) > 1 or len(shared_sizes) > 1 or len(dense_sizes) > 1:
        raise ConfigError(f"{arch} GGUF layers differ in expert, shared-expert or dense MLP size "
                          f"({sorted(expert_sizes)}, {sorted(shared_sizes)}, {sorted(dense_sizes)}); "
                          f"kvbaton needs one size of each")
    if not expert_sizes:
        raise ConfigError(f"{arch} GGUF has no layer with experts")
    expert_size = expert_sizes.pop()
    declared = _field(reader, f"{arch}.expert_feed_forward_length")
    if isinstance(declared, list) and len(set(declared)) == 1:
        declared = declared[0]
    if declared not in (None, expert_size):
        raise ConfigError(f"{arch}.expert_feed_forward_length={declared} does not match the expert tensors "
                          f"({expert_size})")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    norm_topk = _NORM_TOPK_DEFAULT[arch] if norm is None else bool(norm)
    if family == "mixtral" and not norm_topk:
        raise ConfigError("a llama-architecture MoE GGUF without top-k renormalization "
                          "(llama.expert_weights_norm=false) is not supported: Mixtral always renormalizes")
    return _MoE(family=family, num_experts=int(n_experts), top_k=int(top_k), expert_size=expert_size,
                shared_size=shared_sizes.pop(), dense_layers=tuple(dense),
                dense_size=dense_sizes.pop() if dense_sizes else None, norm_topk_prob=norm_topk)


def _check_moe_metadata(reader: GGUFReader, arch: str) -> None:
    """Refuse router and RoPE variants the HF config of these families cannot express."""
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, _SOFTMAX_GATING):
        raise ConfigError(f"{arch}.expert_gating_func={gating} is not supported for {arch} MoE (softmax only)")
    scale = _field(reader, f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):  # llama.cpp applies neither 0 nor 1
        raise ConfigError(f"{arch}.expert_weights_scale={scale} is not supported for {arch} MoE")
    if (_field(reader, f"{arch}.expert_group_count") or 1) > 1:
        raise ConfigError(f"grouped expert routing ({arch}.expert_group_count) is not supported for {arch} MoE")
    rope = _field(reader, f"{arch}.rope.scaling.type")
    if rope not in (None, "none"):
        raise ConfigError(f"RoPE scaling {rope!r} in a {arch} MoE GGUF is not supported")
    heads = _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.embedding_length") // heads)
    rotary = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConfigError(f"partial RoPE ({arch}.rope.dimension_count={rotary} of head size {head_dim}) in a "
                          f"{arch} MoE GGUF is not supported")
    if _field(reader, f"{arch}.attention.sliding_window"):
        raise ConfigError(f"sliding-window attention in a {arch} MoE GGUF is not supported")


def _hf_config(reader: GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]], moe: _MoE | None) -> dict:
    hf_arch, model_type = _MIXTRAL if moe is not None and moe.family == "mixtral" else _ARCHITECTURES[arch]
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if "blk.0.attn_q.bias" in shapes or "blk.0.attn_qkv.bias" in shapes:
        config["attention_bias"] = True
    if moe is not None:
        config.update(_moe_config(reader, arch, moe))
    return config


def _moe_config(reader: GGUFReader, arch: str, moe: _MoE) -> dict:
    """The MoE keys of each family's HF config.json, as `ModelConfig.from_hf_dict` reads them."""
    common = {"num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.norm_topk_prob}
    if moe.family == "mixtral":  # every expert is the model's MLP size
        return {**common, "num_local_experts": moe.num_experts, "intermediate_size": moe.expert_size}
    if moe.family == "olmoe":
        clip = _field(reader, f"{arch}.attention.clamp_kqv")
        return {**common, "num_experts": moe.num_experts, "intermediate_size": moe.expert_size,
                "clip_qkv": float(clip) if clip else None}
    dense_size = moe.dense_size or _field(reader, f"{arch}.feed_forward_length") or moe.expert_size
    config = {**common, "num_experts": moe.num_experts, "moe_intermediate_size": moe.expert_size,
              "intermediate_size": dense_size, "decoder_sparse_step": 1, "mlp_only_layers": list(moe.dense_layers)}
    if moe.family == "qwen2_moe":
        config["shared_expert_intermediate_size"] = moe.shared_size
    return config


# ---- tokenizer -------------------------------------------------------------------------


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        # NOTE: AutoTokenizer first reads the GGUF as a transformers config, which it cannot for some
        # architectures (olmoe: "not supported yet"); the tokenizer itself only needs the tokenizer.* metadata.
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except Exception:
            raise ConfigError(f"cannot build a tokenizer from {gguf_path}: {exc}") from exc
    tokenizer.save_pretrained(str(out_dir))


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as exc:
        raise ConfigError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc
    tokenizer.save_pretrained(str(out_dir))
