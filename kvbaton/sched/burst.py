"""Decode bursts: several decode steps of one batch in one scheduled step (no torch here).

Why: on a CPU, a batch-1 decode step of the default model is ~5 ms in the C layer loop and ~0.4 ms of Python
around it (scheduling, the step's inputs, sampling, the scheduler's update, detokenizing): ~7% of the step, and
slow because the step's weight stream has just evicted every cache the interpreter uses. When each running
request takes its next token from the argmax alone (greedy; no logprobs, penalties, logit bias or grammar;
`min_tokens` reached; not a prefill worker's hand-off), nothing between two of its decode steps needs the
scheduler: the runner runs the steps back to back, each step's argmax the next one's input, and the scheduler
takes the tokens one at a time as if they had come from as many steps. A stop (EOS, a stop token, max_tokens)
ends the request at its token; what was computed past it is dropped. The outputs are the same tokens, a burst
at a time (as vLLM's multi-step scheduling gave them).

A burst holds back the requests that arrive during it for up to `decode_burst - 1` steps, so one runs only
while no request waits or loads. Speculative decoding will reuse the same shape: several tokens of one request
out of one scheduled step.
"""

from __future__ import annotations

from kvbaton.sched.request import Request


def decodes_by_argmax(req: Request) -> bool:
    """Whether `req`'s next tokens are each the argmax of its logits, with nothing else to compute per token."""
    p = req.sampling_params
    return (p.is_greedy and p.logprobs is None and p.prompt_logprobs is None and not p.has_penalties
            and not p.logit_bias and p.structured_output is None and req.num_output_tokens >= p.min_tokens
            and req.remote_decode is None)


def burst_steps(limit: int, requests: list[Request], scheduled_tokens: list[int], token_limit: int) -> int:
    """Decode steps the batch of `requests` (each scheduled `scheduled_tokens`) can run back to back: up to
    `limit`, none past a request's max_tokens or `token_limit` tokens (the context or pool limit); 1 when any of
    them is not a plain greedy decode."""
    steps = limit
    for req, n in zip(requests, scheduled_tokens):
        if steps <= 1 or n != 1 or req.num_computed_tokens != req.num_tokens - 1 or not decodes_by_argmax(req):
            return 1
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            steps = min(steps, max_tokens - req.num_output_tokens)
        steps = min(steps, token_limit - req.num_tokens)
    return max(steps, 1) if requests else 1
