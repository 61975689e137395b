"""Greedy output through kvbaton equals transformers' greedy generate (float32) on tiny
random-weight Llama / Llama-3 (rope scaling, tied) / Qwen2 (qkv bias) / Qwen3 (qk-norm)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import TINY_VOCAB, hf_greedy, hf_logits

from kvbaton import LLM, SamplingParams

ARCHS = ["llama", "llama3", "qwen2", "qwen3"]
MAX_NEW = 12


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache.pool.usage() == 0.0, "blocks still referenced after all requests finished"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = _prompts(0, [1, 3, 16, 17, 40, 77])
    return prompts, {arch: hf_greedy(tiny_models[arch], prompts, MAX_NEW) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_transformers(tiny_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_models[arch]), dtype="float32")
    assert _generate(llm, prompts) == refs[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_small_chunked_prefill_matches(tiny_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_models[arch]), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert _generate(llm, prompts) == refs[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_match(tiny_models, arch):
    shared = _prompts(1, [40])[0]
    prompts = [shared + tail for tail in _prompts(2, [5, 9, 1])] + [shared[:33]]
    refs = hf_greedy(tiny_models[arch], prompts, MAX_NEW)
    llm = LLM(str(tiny_models[arch]), dtype="float32", block_size=8)
    assert _generate(llm, prompts[:1]) == refs[:1]  # warms the cache with the shared prefix
    assert _generate(llm, prompts[1:]) == refs[1:]
    stats = llm.engine.kv_cache.prefix_cache_stats()
    assert stats.hit_tokens >= 3 * 32, stats  # every later prompt reused >= 4 full blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_with_tiny_pool_matches(tiny_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_models[arch]), dtype="float32", block_size=4, num_blocks=32)
    assert _generate(llm, prompts) == refs[arch]
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_caching_off_matches(tiny_models, references):
    prompts, refs = references
    llm = LLM(str(tiny_models["llama"]), dtype="float32", enable_prefix_caching=False, block_size=4)
    assert _generate(llm, prompts + prompts[:2]) == refs["llama"] + refs["llama"][:2]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_within_tolerance(tiny_models, arch):
    """Logprobs reported for the prompt's next token equal transformers' within 1e-4."""
    ids = _prompts(3, [21])[0]
    ref = torch.log_softmax(hf_logits(tiny_models[arch], ids)[-1], -1)
    llm = LLM(str(tiny_models[arch]), dtype="float32")
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    entry = out.outputs[0].logprobs[0]
    for token_id, lp in entry.items():
        assert abs(lp.logprob - float(ref[token_id])) < 1e-4
    assert set(torch.topk(ref, 5).indices.tolist()) <= set(entry)


@pytest.mark.slow
def test_compiled_mlp_matches(tiny_models, references):
    prompts, refs = references
    llm = LLM(str(tiny_models["llama"]), dtype="float32", compile=True)
    assert _generate(llm, prompts) == refs["llama"]
