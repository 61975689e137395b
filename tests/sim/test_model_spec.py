"""ModelSpec: parameter counts against the published figures, KV bytes against the formula written out."""

from __future__ import annotations

import json

import pytest

from kvbaton.config import ConfigError
from kvbaton.sim.model_spec import Dtype, KVDtype, ModelSpec, model_preset, resolve_model


def test_llama_3_70b_kv_is_320_kib_per_token_in_fp16() -> None:
    # Llama-3-70B's public config.json: 80 layers, 8 KV heads, head_dim 8192 / 64 = 128; fp16 = 2 bytes
    layers, kv_heads, head_dim, fp16 = 80, 8, 128, 2
    independent = 2 * layers * kv_heads * head_dim * fp16
    assert independent == 327_680 == 320 * 1024
    assert model_preset("llama-3-70b").kv_bytes_per_token(KVDtype.FP16) == independent


def test_quantized_kv_bytes() -> None:
    m = model_preset("llama-3-70b")
    assert m.kv_bytes_per_token(KVDtype.FP8) == 327_680 // 2  # one byte, per-tensor scale
    # kvbaton's pools: a 4-byte fp32 scale per token, layer, head and K/V
    assert m.kv_bytes_per_token(KVDtype.INT8) == 2 * 80 * 8 * (128 + 4)
    # the default model, as benchmarks/results/kv-quant.md measured it
    assert model_preset("smollm2-135m").kv_bytes_per_token(KVDtype.BF16) == 23_040
    assert model_preset("smollm2-135m").kv_bytes_per_token(KVDtype.FP8_E4M3) == 12_240


def test_deepseek_v3_mla_kv_bytes() -> None:
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes: one latent row shared by all 128 heads
    m = model_preset("deepseek-v3")
    assert m.kv_bytes_per_token(KVDtype.BF16) == 61 * (512 + 64) * 2 == 70_272
    assert m.kv_shards == 1


@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    ("llama-3-70b", 70.6, 70.6), ("llama-3-8b", 8.03, 8.03), ("deepseek-v3", 671, 37),
    ("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9), ("smollm2-135m", 0.135, 0.135)])
def test_parameter_counts_match_the_published_ones(name: str, total_b: float, active_b: float) -> None:
    m = model_preset(name)
    assert m.total_params / 1e9 == pytest.approx(total_b, rel=0.02)
    assert m.active_params / 1e9 == pytest.approx(active_b, rel=0.02)


def test_weight_bytes_and_flops() -> None:
    m = model_preset("llama-3-70b")
    assert m.weight_bytes(Dtype.FP16) == pytest.approx(141e9, rel=0.01)
    assert m.flops_per_token(0) == 2.0 * m.active_params
    assert m.flops_per_token(1000) - m.flops_per_token(0) == 1000 * 4 * 80 * 64 * 128


def test_from_config_json(tmp_path) -> None:
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    m = resolve_model(str(tmp_path))
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.tie_word_embeddings) == (24, 2, 64, True)
    assert m.kv_bytes_per_token(KVDtype.BF16) == 2 * 24 * 2 * 64 * 2


def test_quantized_checkpoint_configs_are_read_for_shapes() -> None:
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
          "quantization_config": {"quant_method": "fp8"}}
    assert ModelSpec.from_hf_dict(hf).num_layers == 2


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="unknown model preset"):
        model_preset("llama-9")
    with pytest.raises(ConfigError, match="unsupported architecture"):
        ModelSpec.from_hf_dict({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="missing or invalid field"):
        ModelSpec.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
