"""Sparse-expert families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) through kvbaton equal transformers' greedy
output (float32) on tiny random checkpoints: mixed batches, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

import random

import pytest
from helpers import MOE_ARCHS, TINY_VOCAB, hf_greedy

from kvbaton import LLM, SamplingParams

MAX_NEW = 12


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    llm.engine.check_integrity()
    assert llm.engine.kv_cache.pool.usage() == 0.0, "blocks still referenced after all requests finished"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(tiny_moe_models):
    prompts = _prompts(0, [1, 3, 16, 17, 40, 77])
    return prompts, {arch: hf_greedy(tiny_moe_models[arch], prompts, MAX_NEW) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_batch_matches_transformers(tiny_moe_models, references, arch):
    prompts, refs = references
    assert _generate(LLM(str(tiny_moe_models[arch]), dtype="float32"), prompts) == refs[arch]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_small_chunked_prefill_matches(tiny_moe_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert _generate(llm, prompts) == refs[arch]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_preemption_with_tiny_pool_matches(tiny_moe_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", block_size=4, num_blocks=32)
    assert _generate(llm, prompts) == refs[arch]
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_cache_hits_match(tiny_moe_models, arch):
    shared = _prompts(1, [40])[0]
    prompts = [shared + tail for tail in _prompts(2, [5, 9, 1])]
    refs = hf_greedy(tiny_moe_models[arch], prompts, MAX_NEW)
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", block_size=8)
    assert _generate(llm, prompts[:1]) == refs[:1]
    assert _generate(llm, prompts[1:]) == refs[1:]
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens >= 2 * 40


def test_every_routed_token_is_counted(tiny_moe_models):
    """The engine's expert load window counts each token k times per MoE layer: what EPLB plans from and
    `GET /experts` shows."""
    llm = LLM(str(tiny_moe_models["qwen2_moe"]), dtype="float32")
    prompt = _prompts(4, [20])[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    load = llm.engine.stats().expert_load
    assert load is not None and load.layers == (0, 2)  # three layers, layer 1 dense (mlp_only_layers)
    computed = len(prompt) + 5 - 1  # the last sampled token is never fed back
    assert load.steps == 5  # the prompt's step and four decodes
    for row in load.counts:
        assert sum(row) == computed * 2  # top-2
        assert sum(1 for tokens in row if tokens) > 2  # routing spreads over experts
