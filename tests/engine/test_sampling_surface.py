"""The sampling surface against its oracle: penalties, logit_bias and the warpers match transformers'
logits processors on the same inputs, row by row inside one batch; OpenAI's presence / frequency
penalties match their published formula; the grammar bitmask matches llguidance's own reference; and
greedy output with the new options at neutral values, with a repetition penalty and with a logit bias
is token-identical to transformers' `generate` (fp32)."""

from __future__ import annotations

import llguidance.numpy
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvbaton import LLM
from kvbaton.engine.sampler import SamplingRow, add_logit_bias, apply_penalties, apply_token_bitmask, warped_logits
from kvbaton.sched.sampling_params import SamplingParams
from tests.support.helpers import TINY_VOCAB, hf_greedy, hf_logits

V = 64


def logits_batch(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3.0


def history(seed: int, length: int) -> list[int]:
    return torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows_for(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]) -> list[SamplingRow]:
    return [SamplingRow(f"r{i}", p, torch.Generator(), (), prompt, out)
            for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs))]


def test_repetition_penalty_matches_transformers_per_row() -> None:
    penalties = [1.0, 1.3, 0.7, 2.0]
    prompts = [history(i, 12) for i in range(4)]
    outputs = [history(10 + i, 5 + i) for i in range(4)]
    logits = logits_batch(4)
    ours = logits.clone()
    apply_penalties(ours, rows_for([SamplingParams(repetition_penalty=p) for p in penalties], prompts, outputs))
    for i, p in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(p)(ids, logits[i: i + 1].clone()) if p != 1.0 else logits[i: i + 1]
        torch.testing.assert_close(ours[i], ref[0], rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    # transformers has no processor for these; OpenAI documents them as
    # logit[j] -= frequency * count[j] + presence * (count[j] > 0), over the generated tokens only
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(presence_penalty=-1.0),
              SamplingParams()]
    prompts = [history(i, 10) for i in range(3)]
    outputs = [[3, 3, 7, 9, 3], [1, 1, 2], [4, 4]]
    logits = logits_batch(3, seed=1)
    ours = logits.clone()
    apply_penalties(ours, rows_for(params, prompts, outputs))
    for i, p in enumerate(params):
        ref = logits[i].clone()
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=V).float()
        ref -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(ours[i], ref)


def test_logit_bias_matches_sequence_bias_processor() -> None:
    biases = [{3: 5.0, 10: -100.0}, None, {0: 2.5}]
    logits = logits_batch(3, seed=2)
    ours = logits.clone()
    add_logit_bias(ours, rows_for([SamplingParams(logit_bias=b) for b in biases], [[]] * 3, [[]] * 3))
    for i, b in enumerate(biases):
        if not b:
            assert torch.equal(ours[i], logits[i])
            continue
        processor = SequenceBiasLogitsProcessor(sequence_bias=[[[t], v] for t, v in b.items()])
        ref = processor(torch.tensor([[1, 2]]), logits[i: i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0])


@pytest.mark.parametrize("seed", range(4))
def test_warpers_match_transformers_chain(seed: int) -> None:
    params = [SamplingParams(temperature=0.7, top_k=10), SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0.5, top_k=20, top_p=0.8,
                                                                         min_p=0.05),
              SamplingParams(temperature=1.0)]
    logits = logits_batch(len(params), seed=seed)
    ours = warped_logits(logits.clone(), params)
    ids = torch.tensor([[0]])
    for i, p in enumerate(params):
        ref = TemperatureLogitsWarper(p.temperature)(ids, logits[i: i + 1].clone())
        if p.top_k:
            ref = TopKLogitsWarper(p.top_k)(ids, ref)
        if p.top_p < 1.0:
            ref = TopPLogitsWarper(p.top_p)(ids, ref)
        if p.min_p:
            ref = MinPLogitsWarper(p.min_p)(ids, ref)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(ref[0])), f"row {i}: different tokens kept"
        kept = torch.isfinite(ref[0])
        torch.testing.assert_close(ours[i][kept], ref[0][kept])


def test_bitmask_matches_llguidance_reference() -> None:
    vocab = 100  # not a multiple of 32: the last word is partial
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(5))
    logits = torch.randn(5, vocab)
    ours = logits.clone()
    apply_token_bitmask(ours, torch.tensor([0, 2, 4]), mask)
    ref = logits[[0, 2, 4]].clone()
    allowed = torch.tensor([[(int(mask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)])
    ref[allowed == 0] = float("-inf")
    assert torch.equal(ours[[0, 2, 4]], ref)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched
    # and llguidance's own reference helper agrees (its numpy twin: the torch one is the same code under
    # torch.compile, ~18 s of compiling for a 3 x 100 check)
    theirs = logits[[0, 2, 4]].clone().numpy()
    llguidance.numpy.apply_token_bitmask_inplace(theirs, mask.numpy())
    assert torch.equal(torch.from_numpy(theirs), ref)


PROMPTS = [[5, 9, 13, 2, 2, 7], list(range(40, 70)), [101, 7, 7, 7]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", block_size=4)


def _greedy(llm: LLM, **kwargs) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kwargs))
    return [o.outputs[0].token_ids for o in outs]


def _hf_generate(model_dir, **kwargs) -> list[list[int]]:
    """transformers' greedy `generate` with its own processors (`kwargs`), never stopping early."""
    return hf_greedy(model_dir, PROMPTS, MAX_NEW, min_new_tokens=MAX_NEW, **kwargs)


def test_neutral_options_keep_greedy_identical_to_transformers(tiny_llm, tiny_models) -> None:
    neutral = _greedy(tiny_llm, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                      logit_bias={})
    assert neutral == hf_greedy(tiny_models["llama"], PROMPTS, MAX_NEW)


def test_repetition_penalty_greedy_matches_transformers_generate(tiny_llm, tiny_models) -> None:
    ours = _greedy(tiny_llm, repetition_penalty=1.5)
    assert ours == _hf_generate(tiny_models["llama"], repetition_penalty=1.5)
    assert ours != hf_greedy(tiny_models["llama"], PROMPTS, MAX_NEW)  # the penalty did change something


def test_logit_bias_greedy_matches_transformers_sequence_bias(tiny_llm, tiny_models) -> None:
    plain = hf_greedy(tiny_models["llama"], PROMPTS, MAX_NEW)
    bias = {plain[0][0]: -100.0, 17: 8.0, TINY_VOCAB - 1: 3.0}
    ours = _greedy(tiny_llm, logit_bias=bias)
    assert ours == _hf_generate(tiny_models["llama"], sequence_bias=[[[t], v] for t, v in bias.items()])
    assert ours != plain


def test_prompt_logprobs_match_transformers_through_chunks_and_a_warm_prefix_cache(tiny_models) -> None:
    llm = LLM(str(tiny_models["llama"]), dtype="float32", block_size=4, max_num_batched_tokens=8)
    prompt = list(range(3, 26))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))  # its blocks now cached
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0,
                                                                    prompt_logprobs=3))[0]
    assert out.metrics.num_cached_tokens == 0  # a cached block has no logits: the prompt is computed again
    ref = hf_logits(tiny_models["llama"], prompt).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        chosen = next(iter(entry.values()))
        assert list(entry)[0] == prompt[i]
        assert abs(chosen.logprob - float(ref[i - 1, prompt[i]])) < 1e-4
        assert set(torch.topk(ref[i - 1], 3).indices.tolist()) <= set(entry)  # the top 3, beside the prompt's own


def test_offline_n_samples_are_seed_plus_index(tiny_llm) -> None:
    prompt = {"prompt_token_ids": list(range(100, 141))}  # fresh: 10 full blocks of 4
    hits = tiny_llm.engine.stats().prefix_cache_hit_tokens
    many = tiny_llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=10))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    # all three were admitted in one step, and the second and third still hit the first one's blocks
    assert tiny_llm.engine.stats().prefix_cache_hit_tokens - hits == 2 * 40
    singles = [tiny_llm.generate(prompt, SamplingParams(temperature=1.0, seed=40 + j, max_tokens=10))[0]
               .outputs[0].token_ids for j in range(3)]
    assert [c.token_ids for c in many.outputs] == singles
    assert len({tuple(t) for t in singles}) == 3


def test_bitmask_narrower_than_the_vocabulary_bans_the_rest() -> None:
    logits = torch.zeros(2, 100)
    mask = torch.full((1, 3), -1, dtype=torch.int32)  # 96 tokens allowed: a tokenizer smaller than the embedding
    apply_token_bitmask(logits, torch.tensor([1]), mask)
    assert torch.equal(logits[0], torch.zeros(100))
    assert torch.equal(torch.isinf(logits[1]), torch.arange(100) >= 96)
