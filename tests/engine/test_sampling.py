"""SamplingParams validation and the sampler: greedy, top-k / top-p, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from kvbaton.engine.sampler import SamplingRow, sample
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams

V = 50  # vocab size


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # its inverse overflows: NaN probabilities
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_invalid_request_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


def test_valid_sampling_params_are_normalised() -> None:
    params = SamplingParams(stop="###", top_k=-1, max_tokens=None, temperature=0.0, top_p=1.0, logprobs=0)
    assert params.stop == ["###"] and params.stop_token_ids == [] and params.is_greedy
    assert SamplingParams(stop=None).stop == [] and not SamplingParams().is_greedy


def logits_batch(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * scale  # [S, V]


def row(params: SamplingParams, seed: int = 0, request_id: str = "r") -> SamplingRow:
    return SamplingRow(request_id, params, torch.Generator().manual_seed(seed))


def draw(logits: torch.Tensor, params: SamplingParams, seed: int, steps: int = 30) -> list[int]:
    """`steps` decode-like draws for one request, sharing its generator across steps."""
    r = row(params, seed)
    return [sample(logits[None], [r])[0][0] for _ in range(steps)]


def test_greedy_is_argmax() -> None:
    logits = logits_batch(6)
    tokens, logprobs = sample(logits, [row(SamplingParams(temperature=0.0))] * 6)
    assert tokens == logits.argmax(-1).tolist() and logprobs == [None] * 6


def test_top_k_1_equals_greedy() -> None:
    logits = logits_batch(6, scale=0.5)  # flat enough that unrestricted sampling would differ
    rows = [row(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(6)]
    assert sample(logits, rows)[0] == logits.argmax(-1).tolist()


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    logits = logits_batch(2, scale=0.1)
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    tokens = [sample(logits, [row(greedy), row(rand, seed=s)])[0] for s in range(10)]
    assert {t[0] for t in tokens} == {int(logits[0].argmax())}
    assert len({t[1] for t in tokens}) > 1


def test_seeded_sampling_is_reproducible_and_differs_across_seeds() -> None:
    logits = logits_batch(1, scale=0.5)[0]
    params = SamplingParams(temperature=1.0)
    assert draw(logits, params, seed=7) == draw(logits, params, seed=7)
    assert draw(logits, params, seed=7) != draw(logits, params, seed=8)
    assert len(set(draw(logits, params, seed=7))) > 5  # it really samples


def test_top_k_keeps_only_the_k_best() -> None:
    logits = logits_batch(1, scale=0.5)[0]
    seen = set(draw(logits, SamplingParams(temperature=2.0, top_k=3), seed=1, steps=200))
    assert seen == set(torch.topk(logits, 3).indices.tolist())


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = logits_batch(1, scale=0.2)[0]
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=1e-6), seed=3)) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_covering_p() -> None:
    probs = torch.tensor([0.05, 0.40, 0.10, 0.35, 0.10])  # sorted: 1 (0.40), 3 (0.75), ...
    logits = probs.log()
    seen = set(draw(logits, SamplingParams(temperature=1.0, top_p=0.5), seed=0, steps=200))
    assert seen == {1, 3}
    seen = set(draw(logits, SamplingParams(temperature=1.0, top_p=0.3), seed=0, steps=200))
    assert seen == {1}


def test_logprobs_are_log_softmax_with_rank_and_ordered_top_n() -> None:
    logits = logits_batch(3, scale=1.0)
    params = SamplingParams(temperature=2.0, logprobs=4)  # reported before temperature, as vLLM does
    tokens, logprobs = sample(logits, [row(params, seed=s) for s in range(3)])
    expected = logits.log_softmax(-1)
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(float(expected[i, token]), abs=1e-6)
        order = expected[i].argsort(descending=True).tolist()
        assert lp.rank == order.index(token) + 1
        assert [t for t, _ in lp.top] == order[:4]
        assert [v for _, v in lp.top] == pytest.approx(expected[i, order[:4]].tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_logprobs_of_a_greedy_token_have_rank_1() -> None:
    logits = logits_batch(1)
    (token,), (lp,) = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=0))])
    assert lp.rank == 1 and lp.top == [] and lp.token_id == token
    assert lp.logprob == pytest.approx(float(logits[0].log_softmax(-1).max()), abs=1e-6)


def test_more_logprobs_than_the_vocab_lists_the_whole_vocab() -> None:
    logits = logits_batch(1)
    (_,), (lp,) = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=V + 10))])
    assert sorted(t for t, _ in lp.top) == list(range(V))
