"""DeepSeek-V3 family (multi-head latent attention + sigmoid-routed MoE) through kvbaton equals
transformers' greedy generate (float32) on tiny random checkpoints: over the paged latent pool,
chunked prefill, prefix hits, preemption, a KV store tier, and prefill/decode disaggregation over shm and tcp."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.config import ConfigError, ModelConfig
from kvbaton.engine.core import model_kv_layout
from kvbaton.layers.linear import Linear
from kvbaton.layers.mla import LatentAttention
from kvbaton.layers.rope import RotaryEmbedding
from kvbaton.models.deepseek import rotate_interleaved
from tests.support.helpers import build_deepseek_checkpoint, greedy_checked, hf_greedy, tiny_prompts

MAX_NEW = 12
LENGTHS = [1, 3, 16, 17, 40, 77]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
# name -> DeepseekV3Config overrides: low-rank q with MoE layers after one dense layer; a plain q_proj with
# biases and rotate-half RoPE; YaRN RoPE scaling (cos/sin and the softmax scale corrected)
VARIANTS = {
    "q_lora": {},
    "plain_q": {"q_lora_rank": None, "attention_bias": True, "rope_interleave": False},
    "yarn": {"rope_parameters": YARN},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: build_deepseek_checkpoint(root / name, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    prompts = tiny_prompts(0, LENGTHS)
    return prompts, {name: hf_greedy(path, prompts, MAX_NEW) for name, path in checkpoints.items()}


def test_config_and_layout(checkpoints):
    cfg = ModelConfig.from_dir(checkpoints["q_lora"])
    assert cfg.architecture == "deepseek_v3" and cfg.mla is not None and cfg.mla.q_lora_rank == 48
    assert cfg.moe is not None and cfg.moe.dense_layers == frozenset({0})
    layout = model_kv_layout(cfg, 4, torch.float32)
    assert layout.is_mla and layout.component_names == ("c_kv", "k_rope")
    assert layout.slot_shape == (32 + 8,) and layout.block_bytes == 4 * 40 * 4  # latent + rope key, not K/V per head
    assert model_kv_layout(cfg, 4, torch.float32, "bfloat16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="latent"):
        model_kv_layout(cfg, 4, torch.float32, "int8")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mixed_batch_matches_transformers(checkpoints, references, name):
    prompts, refs = references
    llm = LLM(str(checkpoints[name]), dtype="float32", num_blocks=64)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs[name]


def test_small_chunked_prefill_matches(checkpoints, references):
    """Chunks of at most 7 tokens, most with prior context read back from the pool, beside decodes."""
    prompts, refs = references
    llm = LLM(str(checkpoints["q_lora"]), dtype="float32", max_num_batched_tokens=7, block_size=4, num_blocks=256)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs["q_lora"]


def test_prefix_cache_hits_match(checkpoints):
    shared = tiny_prompts(1, [40])[0]
    prompts = [shared + tail for tail in tiny_prompts(2, [5, 9, 1])] + [shared[:33]]
    refs = hf_greedy(checkpoints["q_lora"], prompts, MAX_NEW)
    llm = LLM(str(checkpoints["q_lora"]), dtype="float32", block_size=8, num_blocks=64)
    assert greedy_checked(llm, prompts[:1], MAX_NEW) == refs[:1]  # warms the cache with the shared prefix
    assert greedy_checked(llm, prompts[1:], MAX_NEW) == refs[1:]
    stats = llm.engine.kv_cache.prefix_cache_stats()
    assert stats.hit_tokens >= 3 * 32, stats  # every later prompt reused >= 4 full blocks


def test_preemption_with_tiny_pool_matches(checkpoints, references):
    prompts, refs = references
    llm = LLM(str(checkpoints["q_lora"]), dtype="float32", block_size=4, num_blocks=32)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs["q_lora"]
    assert llm.engine.stats().num_preemptions > 0


def test_kv_store_tier_serves_latent_blocks_to_another_engine(checkpoints, references, tmp_path):
    """A disk tier keyed by the MLA layout: a second engine (fresh pool) loads the first one's prefix blocks."""
    from kvbaton.config import KVStoreConfig

    prompts, refs = references
    store = KVStoreConfig(tiers=("disk",), disk_dir=str(tmp_path))
    for expect_hits in (False, True):
        llm = LLM(str(checkpoints["q_lora"]), dtype="float32", block_size=8, num_blocks=64, kv_store=store)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[4:]],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW))
        assert [list(o.outputs[0].token_ids) for o in outs] == refs["q_lora"][4:]
        cached = [o.metrics.num_cached_tokens for o in outs]
        assert cached == ([32, 72] if expect_hits else [0, 0]), cached  # whole blocks, the last token computed
        llm.engine.core.check_integrity()
        llm.engine.core.close()


def test_deterministic_mode_is_refused(checkpoints):
    with pytest.raises(ConfigError, match="latent attention"):
        LLM(str(checkpoints["q_lora"]), dtype="float32", deterministic=True)


def test_absorbed_decode_equals_naive_attention():
    """The decode form (queries absorbed into latent space through W_UK, W_UV after) equals up-projecting
    every context row into per-head keys and values."""
    torch.manual_seed(0)
    heads, rank, nope, rope_dim, v_dim, length = 4, 32, 16, 8, 16, 23
    kv_b = Linear(rank, heads * (nope + v_dim), bias=False)
    attn = LatentAttention(heads, rank, nope, rope_dim, v_dim, scale=(nope + rope_dim) ** -0.5)
    context = torch.randn(length, rank + rope_dim)
    q = torch.randn(length, heads, nope + rope_dim)
    with torch.no_grad():
        naive = attn.naive(q, context, None, kv_b)  # causal: query i sees rows 0..i
        for i in (0, 5, length - 1):
            mask = torch.zeros(1, 1, i + 1)
            absorbed = attn.absorbed(q[i:i + 1], context[None, : i + 1], mask, kv_b)[0]
            torch.testing.assert_close(absorbed, naive[i], atol=1e-5, rtol=1e-5)
        # padded context: masked rows count for nothing
        padded = torch.cat([context, torch.randn(5, rank + rope_dim)])[None]
        mask = torch.zeros(1, 1, length + 5)
        mask[..., length:] = float("-inf")
        torch.testing.assert_close(attn.absorbed(q[-1:], padded, mask, kv_b)[0], naive[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [
    {}, {"truncate": False, "beta_fast": 8.0, "mscale_all_dim": 0.0},
    {"attention_factor": 0.9, "factor": 8.0, "original_max_position_embeddings": 32},
])
def test_yarn_matches_transformers(overrides):
    """Inverse frequencies and cos/sin scale bit for bit, and DeepSeek's softmax scale, as transformers has them."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from kvbaton.layers.rope import attention_factor, inverse_frequencies
    from kvbaton.models.deepseek import softmax_scale

    hf = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                          q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                          max_position_embeddings=256, rope_parameters={**YARN, **overrides})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    assert cfg.rope_scaling is not None and cfg.mla is not None
    assert torch.equal(inverse_frequencies(16, cfg.rope_theta, cfg.rope_scaling), inv_freq)
    assert attention_factor(cfg.rope_scaling) == factor
    assert softmax_scale(cfg, cfg.mla) == DeepseekV3Attention(hf, 0).scaling


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    rope = RotaryEmbedding(8, 64, 10000.0, None, torch.float32)
    positions = torch.tensor([0, 3, 17, 63])
    x = torch.randn(4, 3, 8)
    cos, signed_sin = rope.cos[positions], rope.sin[positions]  # signed: [-sin, sin]
    sin = torch.cat((signed_sin[:, 4:], signed_sin[:, 4:]), dim=-1)  # transformers': [sin, sin]
    ref, _ = apply_rotary_pos_emb_interleave(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rotate_interleaved(x, rope.cos_sin(positions)), ref[0].transpose(0, 1))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_1p1d_matches_transformers(checkpoints, references, transport):
    """Prefill workers hand the latent blocks over layer by layer; a repeated prompt is a full prefix hit on
    the decode worker, over the blocks it received."""
    from tests.support.pd import collect, router_over, run

    prompts, refs = references
    chosen = [0, 1, 2, 4]  # 1, 3, 16 and 40 tokens (blocks of 4: under one block, whole blocks, a partial one)

    async def scenario() -> tuple[list[list[int]], list[int], dict[str, int], int]:
        async with router_over(checkpoints["q_lora"], prefill=1, decode=1, transport=transport,
                               local_prefill_threshold=0) as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", prompts[i], MAX_NEW) for i in chosen))
            hits_before = router.stats.prefix_cache_hit_tokens
            again = await collect(router, "again", prompts[4], MAX_NEW)
            return outs, again, dict(router.counters), router.stats.prefix_cache_hit_tokens - hits_before

    outs, again, counters, hit_tokens = run(scenario())
    assert outs == [refs["q_lora"][i] for i in chosen] and again == refs["q_lora"][4]
    assert counters["disaggregated"] == 5 and counters["fallbacks"] == 0, counters
    assert hit_tokens >= 36, "the decode worker's prefix cache should have skipped the received blocks"
