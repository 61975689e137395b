"""Sparse-expert GGUFs (Mixtral as llama, qwen2moe, qwen3moe, olmoe) convert to the HF checkpoint they came from.

CI has no llama.cpp, so `write_gguf` lays the tiny HF checkpoints out as llama.cpp's `convert_hf_to_gguf.py`
does (its conversion/{base,llama,qwen,olmo}.py): names from gguf-py's tensor map, experts stacked per layer
([E, I, H] gate/up, [E, H, I] down), the llama arch's q/k row permutation, its metadata keys, and its rules for
which tensors stay F32 when the rest is quantized. Checked by hand against the real converter (llama.cpp's
vendored copy in llama-cpp-python 0.3.36), on tiny checkpoints of all four families with SmolLM2's tokenizer:
byte-identical tensors (f32, and Q8_0 for Qwen3-MoE) and the same metadata keys. The tiny WordLevel tokenizers
cannot be rebuilt from GGUF metadata, so the conversion here takes the HF directory's (`tokenizer_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvbaton import LLM, SamplingParams
from kvbaton.config import ConfigError, ModelConfig
from kvbaton.models.gguf_convert import convert_gguf
from tests.support.helpers import MOE_ARCHS, hf_greedy, hf_logits, tiny_prompts

MAX_NEW = 8
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
F32 = gguf.GGMLQuantizationType.F32


def _hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (n_head already the kv heads for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stacked(weights: dict[str, torch.Tensor], cfg: dict, arch: str) -> dict[str, torch.Tensor]:
    """HF names -> the names llama.cpp's modify_tensors hands to the tensor map: experts stacked per layer."""
    out = {}
    experts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, w in weights.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.<i>.{mlp|block_sparse_moe}.experts.<e>.<proj>.weight
            layer, expert, proj = parts[2], int(parts[5]), parts[6]
            merged = (f"layers.{layer}.feed_forward.experts.{proj}.weight" if arch == "mixtral"
                      else f"model.layers.{layer}.mlp.experts.{proj}.weight")
            experts.setdefault(merged, []).append((expert, w))
            continue
        if arch == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            w = _permute(w, heads)
        out[name] = w
    for merged, items in experts.items():
        out[merged] = torch.stack([w for _, w in sorted(items, key=lambda item: item[0])])
    return out


def _add_metadata(writer: gguf.GGUFWriter, cfg: dict, arch: str, qtype: gguf.GGMLQuantizationType) -> None:
    """TextModel.set_gguf_parameters plus the MoE families' own keys."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else cfg["rms_norm_eps"])  # OlmoeModel forces 1e-5
    writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == gguf.GGMLQuantizationType.Q8_0
                         else gguf.LlamaFileType.ALL_F32)
    if arch == "mixtral":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch in ("qwen2_moe", "qwen3_moe"):  # Qwen2MoeModel.set_gguf_parameters
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "olmoe" and cfg.get("clip_qkv") is not None:
        # NOTE: llama.cpp's OlmoeModel does not write clip_qkv (its OlmoModel does, as this key); real OLMoE
        # checkpoints have none. The tiny one clips, so the key carries it here.
        writer.add_clamp_kqv(cfg["clip_qkv"])


def _fused(tensors: dict[str, np.ndarray], blocks: int) -> dict[str, np.ndarray]:
    """llama.cpp's --fuse-qkv (q, k, v rows concatenated, after the llama permutation) and --fuse-gate-up-exps
    (gate then up rows of each expert), as ModelBase.modify_tensors does them."""
    out = dict(tensors)
    for i in range(blocks):
        for suffix in ("weight", "bias"):
            names = [f"blk.{i}.attn_{p}.{suffix}" for p in "qkv"]
            if names[0] in out:
                out[f"blk.{i}.attn_qkv.{suffix}"] = np.concatenate([out.pop(n) for n in names], axis=0)
        gate_up = [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up")]
        if gate_up[0] in out:
            out[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([out.pop(n) for n in gate_up], axis=1)
    return out


def write_gguf(hf_dir: Path, path: Path, qtype: gguf.GGMLQuantizationType = F32, extra: dict | None = None,
               drop: tuple[str, ...] = (), add: dict[str, np.ndarray] | None = None, fuse: bool = False) -> Path:
    """The GGUF llama.cpp's converter writes for `hf_dir`, tensors in `qtype` (F32 for norms, 1-D tensors and
    routers, as its prepare_tensors decides), with --fuse-qkv and --fuse-gate-up-exps when `fuse`. `extra`
    (key -> value), `drop` (names) and `add` (name -> array) alter it, for the refusal tests."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg["model_type"]
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    _add_metadata(writer, cfg, arch, qtype)
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    blocks = cfg["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[arch].upper()], blocks)
    # NOTE: llama.cpp's qwen2moe lists no dense FFN tensors, so its converter refuses a checkpoint with
    # mlp_only_layers (the tiny Qwen2-MoE's layer 1); such a layer gets the generic dense names here.
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks)
    tensors = {}
    for name, w in _stacked(_hf_weights(hf_dir), cfg, arch).items():
        new_name = (tmap.get_name(name, try_suffixes=(".weight", ".bias"))
                    or dense_map.get_name(name, try_suffixes=(".weight", ".bias")))
        assert new_name is not None, name
        tensors[new_name] = w.numpy()
    if fuse:
        tensors = _fused(tensors, blocks)
    tensors.update(add or {})
    for new_name, data in tensors.items():
        if new_name in drop:
            continue
        kind = new_name.split(".")[-2]
        dtype = qtype
        if data.ndim <= 1 or new_name.endswith("_norm.weight") or kind in ("ffn_gate_inp", "ffn_gate_inp_shexp"):
            dtype = F32
        try:
            raw = gguf.quants.quantize(data, dtype)
        except gguf.QuantError:  # rows not a multiple of the block size, as llama.cpp falls back
            dtype = gguf.GGMLQuantizationType.F16
            raw = gguf.quants.quantize(data, dtype)
        writer.add_tensor(new_name, raw, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted(tiny_moe_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-moe")
    out = {}
    for arch in MOE_ARCHS:
        path = write_gguf(tiny_moe_models[arch], root / f"{arch}.gguf")
        out[arch] = convert_gguf(path, root / arch, dtype=torch.float32, tokenizer_dir=tiny_moe_models[arch])
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_converted_weights_and_config_equal_the_checkpoint(tiny_moe_models, converted, arch):
    hf, ours = _hf_weights(tiny_moe_models[arch]), _hf_weights(converted[arch])
    assert sorted(ours) == sorted(hf)
    for name, w in hf.items():
        assert torch.equal(ours[name], w), name
    assert ModelConfig.from_dir(converted[arch]) == ModelConfig.from_dir(tiny_moe_models[arch])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_converted_greedy_matches_transformers(tiny_moe_models, converted, arch):
    prompts = tiny_prompts(0, [1, 29])
    llm = LLM(str(converted[arch]), dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_moe_models[arch], prompts, MAX_NEW)


def test_q8_0_experts_convert_within_quantization_error(tiny_moe_models, tmp_path):
    """Q8_0 (the matrices; norms and routers stay F32): weights within a block's rounding step, and the
    model's prompt logprobs near transformers' on the original fp32 checkpoint."""
    hf_dir = tiny_moe_models["qwen3_moe"]
    path = write_gguf(hf_dir, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ffn_gate_inp.weight"] == F32
    out = convert_gguf(path, tmp_path / "q8", dtype=torch.float32, tokenizer_dir=hf_dir)
    hf, ours = _hf_weights(hf_dir), _hf_weights(out)
    assert sorted(ours) == sorted(hf)
    for name, w in hf.items():
        # Q8_0: 32 values share one float16 scale, max |w| / 127; rounding is half a step, plus the scale's error
        step = w.abs().max() / 127
        assert (ours[name] - w).abs().max() <= 0.6 * step, name
    assert not torch.equal(ours["model.layers.0.mlp.experts.3.down_proj.weight"],
                           hf["model.layers.0.mlp.experts.3.down_proj.weight"])
    prompt = tiny_prompts(1, [24])[0]
    llm = LLM(str(out), dtype="float32")
    (res,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert res.prompt_logprobs is not None
    got = torch.tensor([next(iter(d.values())).logprob for d in res.prompt_logprobs[1:]])
    positions = torch.arange(len(prompt) - 1)

    def reference(model_dir: Path) -> torch.Tensor:
        return torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)[positions, prompt[1:]]

    # the converted Q8_0 model itself (transformers loads the directory too): kvbaton computes it exactly
    assert torch.allclose(got, reference(out), atol=1e-3)
    # near the fp32 original: quantization moves most logprobs by a few hundredths; a token whose top-2
    # experts flip moves more, so the bound is on the typical position
    diff = (got - reference(hf_dir)).abs()
    assert diff.median() < 0.1 and (diff < 0.2).float().mean() > 0.75, diff


@pytest.mark.parametrize(("arch", "key", "value", "norm"), [
    ("qwen2_moe", None, None, False),  # llama.cpp's qwen2moe graph: no renormalization
    ("qwen2_moe", "qwen2moe.expert_weights_norm", True, True),  # a converter that wrote the key wins
    ("olmoe", None, None, False),
    ("qwen3_moe", None, None, True),
    ("mixtral", None, None, True),
])
def test_norm_topk_prob_default_and_key(tiny_moe_models, tmp_path, arch, key, value, norm):
    path = write_gguf(tiny_moe_models[arch], tmp_path / "m.gguf", extra={key: value} if key else None)
    out = convert_gguf(path, tmp_path / "m", dtype=torch.float32, tokenizer_dir=tiny_moe_models[arch])
    moe = ModelConfig.from_dir(out).moe
    assert moe is not None and moe.norm_topk_prob is norm


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fused_qkv_and_gate_up_experts_split_back(tiny_moe_models, tmp_path, arch):
    """llama.cpp's --fuse-qkv / --fuse-gate-up-exps layouts: Mixtral's permuted q/k, Qwen2-MoE's biases."""
    path = write_gguf(tiny_moe_models[arch], tmp_path / "fused.gguf", fuse=True)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_gate_up_exps.weight" in names
    out = convert_gguf(path, tmp_path / "fused", dtype=torch.float32, tokenizer_dir=tiny_moe_models[arch])
    hf, ours = _hf_weights(tiny_moe_models[arch]), _hf_weights(out)
    assert sorted(ours) == sorted(hf)
    for name, w in hf.items():
        assert torch.equal(ours[name], w), name


def test_dense_layers_become_mlp_only_layers(converted):
    cfg = json.loads((converted["qwen2_moe"] / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [1] and cfg["intermediate_size"] == 96
    assert cfg["moe_intermediate_size"] == 32 and cfg["shared_expert_intermediate_size"] == 48


@pytest.mark.parametrize(("arch", "change", "reason"), [
    ("qwen3_moe", {"extra": {"qwen3moe.expert_gating_func": 2}}, "expert_gating_func"),
    ("qwen3_moe", {"extra": {"qwen3moe.expert_weights_scale": 2.5}}, "expert_weights_scale"),
    ("qwen3_moe", {"extra": {"qwen3moe.expert_group_count": 4}}, "grouped expert routing"),
    ("qwen3_moe", {"extra": {"qwen3moe.rope.scaling.type": "yarn"}}, "RoPE scaling 'yarn'"),
    ("mixtral", {"extra": {"llama.rope.dimension_count": 8}}, "partial RoPE"),
    ("mixtral", {"extra": {"llama.expert_weights_norm": False}}, "Mixtral always renormalizes"),
    ("qwen3_moe", {"add": {"blk.0.ffn_gate_shexp.weight": np.zeros((16, 64), np.float32)}}, "ffn_gate_shexp"),
    ("qwen2_moe", {"drop": ("blk.0.ffn_gate_inp_shexp.weight",)}, "without its gate"),
    ("mixtral", {"drop": ("blk.2.ffn_gate_exps.weight",)}, "ungated experts"),
    ("olmoe", {"drop": ("blk.1.ffn_gate_inp.weight",)}, "dense layers are supported only"),
    ("qwen3_moe", {"add": {"blk.0.ffn_gate.weight": np.zeros((96, 64), np.float32)}}, "both experts and"),
    ("mixtral", {"add": {"rope_freqs.weight": np.ones(8, np.float32)}}, "rope_freqs"),
])
def test_unsupported_variants_are_refused(tiny_moe_models, tmp_path, arch, change, reason):
    path = write_gguf(tiny_moe_models[arch], tmp_path / "bad.gguf", **change)
    with pytest.raises(ConfigError, match=reason):
        convert_gguf(path, tmp_path / "bad", dtype=torch.float32, tokenizer_dir=tiny_moe_models[arch])
    assert not (tmp_path / "bad" / "config.json").exists()
