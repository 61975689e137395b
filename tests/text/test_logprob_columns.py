"""Logprobs in the frontend: kept as columns, appended once per position, each step's output a view of the
positions so far (no per-step copy of the whole list), rendered to vLLM's shape only when read."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvbaton.sched.outputs import EngineCoreOutput, FinishReason, TokenLogprobs
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.logprob_columns import LogprobColumns, LogprobsView
from kvbaton.text.output_processor import OutputProcessor
from kvbaton.text.request_output import Logprob
from kvbaton.text.tokenizer import Tokenizer


def entries(count: int, top: int, seed: int = 0) -> list[TokenLogprobs]:
    rng = random.Random(seed)
    return [TokenLogprobs(rng.randrange(50), -rng.random(), rng.randrange(1, 4),
                          [(rng.randrange(50), -rng.random()) for _ in range(top)]) for _ in range(count)]


def vllm_shape(entry: TokenLogprobs, text) -> dict[int, Logprob]:
    """What vLLM (and kvbaton before the columns) hands out: the chosen token first, then the top N by rank."""
    ranked = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        ranked.setdefault(token_id, Logprob(logprob, rank, text(token_id)))
    return ranked


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]) -> Tokenizer:
    return Tokenizer(tiny_models["llama"])


def test_a_view_reads_as_the_list_of_dicts_it_stands_for(tokenizer: Tokenizer) -> None:
    made = entries(30, top=5)
    columns = LogprobColumns()
    for entry in made:
        columns.append(entry)
    view = LogprobsView(columns, len(columns), tokenizer.token_text)
    expected = [vllm_shape(e, tokenizer.token_text) for e in made]
    assert view == expected and list(view) == expected and len(view) == 30
    assert view[-1] == expected[-1] and view[3:7] == expected[3:7] and view[::-5] == expected[::-5]
    with pytest.raises(IndexError):
        view[30]


def test_each_step_shares_the_columns_and_keeps_its_own_length(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(logprobs=4, max_tokens=8), arrival_time=0.0)
    made = entries(8, top=4, seed=1)
    views = []
    for i, entry in enumerate(made):
        out, _ = processor.process(EngineCoreOutput(
            request_id="r", new_token_ids=[entry.token_id], logprobs=[entry],
            finish_reason=FinishReason.LENGTH if i == len(made) - 1 else None))
        views.append(out.outputs[0].logprobs)
    assert [len(v) for v in views] == list(range(1, 9))  # an early step's view still reads as it was
    assert len({id(v._columns) for v in views}) == 1  # one set of columns, appended to: no per-step copy
    assert views[-1] == [vllm_shape(e, tokenizer.token_text) for e in made]
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e.logprob for e in made))


def test_prompt_logprobs_read_none_first(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("p", None, [5, 6, 7, 8], SamplingParams(prompt_logprobs=2, max_tokens=1), arrival_time=0.0)
    predicted = entries(3, top=2, seed=2)
    out, _ = processor.process(EngineCoreOutput(request_id="p", new_token_ids=[9], prompt_logprobs=predicted,
                                                finish_reason=FinishReason.LENGTH))
    assert out.prompt_logprobs == [None, *(vllm_shape(e, tokenizer.token_text) for e in predicted)]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
