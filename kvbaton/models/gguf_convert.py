"""Convert a GGUF file into an HF-style checkpoint directory (config, safetensors, tokenizer).

Weights are dequantized with the `gguf` package; the tokenizer and chat template are
rebuilt by `transformers` from the GGUF metadata. The result loads like any HF directory.
"""

from __future__ import annotations

import json
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
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `out_dir` with config.json, model.safetensors and the tokenizer; returns it."""
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
    tensors = _dequantized_tensors(reader, arch, dtype)
    config = _hf_config(reader, arch, tied="lm_head.weight" not in tensors,
                        vocab_size=tensors["model.embed_tokens.weight"].shape[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(gguf_path, out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _dequantized_tensors(reader: GGUFReader, arch: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    out: dict[str, torch.Tensor] = {}
    # NOTE: disable=None is tqdm's own TTY check: a bar on a terminal, nothing in logs, CI or test output.
    for t in tqdm(reader.tensors, desc="kvbaton: converting GGUF", unit="tensor", disable=None, leave=False):
        name = _hf_name(t.name)
        if name is None:
            continue
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter permutes q/k rows for its RoPE; undo it for HF's layout.
            data = _unpermute(data, heads if "q_proj" in name else kv_heads)
        out[name] = torch.from_numpy(data).to(dtype)
    return out


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(reader: GGUFReader, arch: str, tied: bool, vocab_size: int) -> dict:
    hf_arch, model_type = _ARCHITECTURES[arch]
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    return config


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ConfigError(f"cannot build a tokenizer from {gguf_path}: {exc}") from exc
    tokenizer.save_pretrained(str(out_dir))
