"""OutputBudget: what one request may ask to produce (choices x max_tokens x (1 + top logprobs)), and the
prompt logprobs one output may carry. Pure: the served refusal is in test_hardening_api's hostile table."""

from __future__ import annotations

import pytest

from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.server.errors import ApiError
from kvbaton.server.output_budget import MAX_PROMPT_LOGPROB_ENTRIES, OutputBudget, default_max_output_units

CONTEXT = 8192


@pytest.fixture
def budget() -> OutputBudget:
    return OutputBudget(default_max_output_units(max_n=16, max_model_len=CONTEXT), CONTEXT)


def test_the_default_admits_plain_n_sampling_and_full_logprobs_at_full_context(budget):
    budget.check([10], SamplingParams(n=16, max_tokens=None), "top_logprobs")
    budget.check([10], SamplingParams(n=16, max_tokens=CONTEXT - 10), "logprobs")
    budget.check([1], SamplingParams(n=1, max_tokens=None, logprobs=20), "top_logprobs")
    budget.check([CONTEXT - 1], SamplingParams(prompt_logprobs=20), "logprobs")


def test_the_field_report_is_refused_naming_its_fields(budget):
    with pytest.raises(ApiError) as refused:
        budget.check([5] * 16, SamplingParams(n=16, max_tokens=8000, logprobs=20), "logprobs")
    error = refused.value
    assert error.status == 400 and error.param == "max_tokens"
    assert "asks for 43008000 output tokens" in error.message
    assert "16 prompt(s), n=16, max_tokens=8000, logprobs=20" in error.message
    assert "--max-request-output-tokens" in error.message


def test_an_unset_max_tokens_counts_as_the_rest_of_the_context():
    small = OutputBudget(max_units=4 * CONTEXT, max_model_len=CONTEXT)
    small.check([CONTEXT // 2], SamplingParams(n=8, max_tokens=None), "top_logprobs")  # 8 x 4096: at the budget
    with pytest.raises(ApiError, match=r"max_tokens unset \(up to 8191 tokens\)"):
        small.check([1], SamplingParams(n=8, max_tokens=None), "top_logprobs")


def test_prompt_logprobs_are_bounded_by_what_one_output_may_carry():
    huge = OutputBudget(max_units=2**40, max_model_len=2**20)
    prompt = MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1
    with pytest.raises(ApiError) as refused:
        huge.check([prompt], SamplingParams(prompt_logprobs=20), "logprobs")
    assert refused.value.param == "prompt_logprobs"
    huge.check([prompt], SamplingParams(prompt_logprobs=10), "logprobs")
