"""Sparse-expert families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) through kvbaton equal transformers' greedy
output (float32) on tiny random checkpoints: mixed batches, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

import pytest

from kvbaton import LLM, SamplingParams
from tests.support.helpers import MOE_ARCHS, greedy_checked, hf_greedy, tiny_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def references(tiny_moe_models):
    prompts = tiny_prompts(0, [1, 3, 16, 17, 40, 77])
    return prompts, {arch: hf_greedy(tiny_moe_models[arch], prompts, MAX_NEW) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_batch_matches_transformers(tiny_moe_models, references, arch):
    prompts, refs = references
    assert greedy_checked(LLM(str(tiny_moe_models[arch]), dtype="float32"), prompts, MAX_NEW) == refs[arch]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_small_chunked_prefill_matches(tiny_moe_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs[arch]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_preemption_with_tiny_pool_matches(tiny_moe_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", block_size=4, num_blocks=32)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs[arch]
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_cache_hits_match(tiny_moe_models, arch):
    shared = tiny_prompts(1, [40])[0]
    prompts = [shared + tail for tail in tiny_prompts(2, [5, 9, 1])]
    refs = hf_greedy(tiny_moe_models[arch], prompts, MAX_NEW)
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", block_size=8)
    assert greedy_checked(llm, prompts[:1], MAX_NEW) == refs[:1]
    assert greedy_checked(llm, prompts[1:], MAX_NEW) == refs[1:]
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens >= 2 * 40


def test_every_routed_token_is_counted(tiny_moe_models):
    """The engine's expert load window counts each token k times per MoE layer: what EPLB plans from and
    `GET /experts` shows."""
    llm = LLM(str(tiny_moe_models["qwen2_moe"]), dtype="float32")
    prompt = tiny_prompts(4, [20])[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    load = llm.engine.stats().expert_load
    assert load is not None and load.layers == (0, 2)  # three layers, layer 1 dense (mlp_only_layers)
    computed = len(prompt) + 5 - 1  # the last sampled token is never fed back
    assert load.steps == 5  # the prompt's step and four decodes
    for row in load.counts:
        assert sum(row) == computed * 2  # top-2
        assert sum(1 for tokens in row if tokens) > 2  # routing spreads over experts
