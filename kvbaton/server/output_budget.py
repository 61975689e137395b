"""What one request may ask the server to produce, bounded before it is admitted.

Admission bounds prompt tokens; this bounds the other side. A request's output costs the frontend
memory and a response body in proportion to choices x tokens x (1 + top logprobs): 16 prompts x
n=16 x max_tokens=8000 x 20 logprobs is ~2 M annotated tokens (~9 GB in the frontend, a ~3 GB
JSON body), which a server without this bound accepted from one client. An unset `max_tokens`
counts as its effective limit: the rest of the context.

The default admits the two plain uses at full context: n-sampling at `--max-n`, and one choice
with the most top logprobs (20).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.server.errors import ApiError

MAX_TOP_LOGPROBS = 20  # the API's own bound on logprobs / top_logprobs / prompt_logprobs
# NOTE: a first output carries the prompt's logprobs to the router in one frame (64 MiB at most); an entry is
# ~14 bytes there (a token id and a float), so this keeps that frame within half the limit.
MAX_PROMPT_LOGPROB_ENTRIES = 2**21


def default_max_output_units(max_n: int, max_model_len: int) -> int:
    return max(max_n, 1 + MAX_TOP_LOGPROBS) * max_model_len


@dataclass(frozen=True)
class OutputBudget:
    max_units: int  # choices x tokens x (1 + top logprobs), summed over the request's prompts
    max_model_len: int

    def check(self, prompt_lengths: Sequence[int], params: SamplingParams, logprobs_param: str) -> None:
        """ApiError 400, naming the fields that make it, if the request asks for more than the budget."""
        per_token = 1 + (params.logprobs or 0)
        tokens = sum(params.max_tokens if params.max_tokens is not None else self.max_model_len - length
                     for length in prompt_lengths)
        units = params.n * tokens * per_token
        if units > self.max_units:
            fields = [f"{len(prompt_lengths)} prompt(s)"] if len(prompt_lengths) > 1 else []
            fields += [f"n={params.n}", f"max_tokens={params.max_tokens}" if params.max_tokens is not None
                       else f"max_tokens unset (up to {tokens // len(prompt_lengths)} tokens)"]
            fields += [f"{logprobs_param}={params.logprobs}"] if params.logprobs else []
            raise ApiError(400, f"this request asks for {units} output tokens (choices x max_tokens x "
                                f"(1 + {logprobs_param})): {', '.join(fields)}; this server allows {self.max_units} "
                                f"per request (--max-request-output-tokens)", "BadRequestError", "max_tokens")
        if params.prompt_logprobs is not None:
            entries = max(prompt_lengths) * (1 + params.prompt_logprobs)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise ApiError(400, f"prompt_logprobs={params.prompt_logprobs} over a prompt of {max(prompt_lengths)} "
                                    f"tokens is {entries} entries, more than the {MAX_PROMPT_LOGPROB_ENTRIES} one "
                                    f"output may carry: ask for fewer", "BadRequestError", "prompt_logprobs")
