"""Greedy output through kvbaton equals transformers' greedy generate (float32) on tiny
random-weight Llama / Llama-3 (rope scaling, tied) / Qwen2 (qkv bias) / Qwen3 (qk-norm)."""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM, SamplingParams
from tests.support.helpers import greedy_checked, hf_greedy, hf_logits, tiny_prompts

ARCHS = ["llama", "llama3", "qwen2", "qwen3"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = tiny_prompts(0, [1, 3, 16, 17, 40, 77])
    return prompts, {arch: hf_greedy(tiny_models[arch], prompts, MAX_NEW) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_transformers(tiny_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_models[arch]), dtype="float32")
    assert greedy_checked(llm, prompts, MAX_NEW) == refs[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_small_chunked_prefill_matches(tiny_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_models[arch]), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_match(tiny_models, arch):
    shared = tiny_prompts(1, [40])[0]
    prompts = [shared + tail for tail in tiny_prompts(2, [5, 9, 1])] + [shared[:33]]
    refs = hf_greedy(tiny_models[arch], prompts, MAX_NEW)
    llm = LLM(str(tiny_models[arch]), dtype="float32", block_size=8)
    assert greedy_checked(llm, prompts[:1], MAX_NEW) == refs[:1]  # warms the cache with the shared prefix
    assert greedy_checked(llm, prompts[1:], MAX_NEW) == refs[1:]
    stats = llm.engine.kv_cache.prefix_cache_stats()
    assert stats.hit_tokens >= 3 * 32, stats  # every later prompt reused >= 4 full blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_with_tiny_pool_matches(tiny_models, references, arch):
    prompts, refs = references
    llm = LLM(str(tiny_models[arch]), dtype="float32", block_size=4, num_blocks=32)
    assert greedy_checked(llm, prompts, MAX_NEW) == refs[arch]
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_caching_off_matches(tiny_models, references):
    prompts, refs = references
    llm = LLM(str(tiny_models["llama"]), dtype="float32", enable_prefix_caching=False, block_size=4)
    assert greedy_checked(llm, prompts + prompts[:2], MAX_NEW) == refs["llama"] + refs["llama"][:2]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_within_tolerance(tiny_models, arch):
    """Logprobs reported for the prompt's next token equal transformers' within 1e-4."""
    ids = tiny_prompts(3, [21])[0]
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
    assert greedy_checked(llm, prompts, MAX_NEW) == refs["llama"]
