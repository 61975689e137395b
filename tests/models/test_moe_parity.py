"""Sparse-expert families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) through kvbaton equal transformers' greedy
output (float32) on tiny random checkpoints: mixed batches, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

import random

import pytest
from helpers import MOE_ARCHS, TINY_VOCAB, hf_greedy

from kvbaton import LLM, SamplingParams
from kvbaton.layers.moe.block import SparseMoeBlock

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


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_preemption_with_tiny_pool_matches(tiny_moe_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", block_size=4, num_blocks=32)
    assert _generate(llm, prompts) == refs[arch]
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_prefix_cache_hits_match(tiny_moe_models, arch):
    shared = _prompts(1, [40])[0]
    prompts = [shared + tail for tail in _prompts(2, [5, 9, 1])]
    refs = hf_greedy(tiny_moe_models[arch], prompts, MAX_NEW)
    llm = LLM(str(tiny_moe_models[arch]), dtype="float32", block_size=8)
    assert _generate(llm, prompts[:1]) == refs[:1]
    assert _generate(llm, prompts[1:]) == refs[1:]
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens >= 2 * 40


def test_every_routed_token_is_counted(tiny_moe_models):
    """The MoE blocks count each token k times per MoE layer: the load statistics EPLB plans from."""
    llm = LLM(str(tiny_moe_models["qwen2_moe"]), dtype="float32")
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2  # three layers, layer 1 dense (mlp_only_layers)
    for block in blocks:
        block.take_token_counts()
    prompt = _prompts(4, [20])[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    computed = len(prompt) + 5 - 1  # the last sampled token is never fed back
    for block in blocks:
        counts = block.take_token_counts()
        assert int(counts.sum()) == computed * block.moe.top_k
        assert int((counts > 0).sum()) > 2  # routing spreads over experts
        assert int(block.take_token_counts().sum()) == 0
