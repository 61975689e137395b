"""Turn a step's logits into next tokens: greedy, temperature / top-k / top-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbaton.engine.outputs import TokenLogprobs
from kvbaton.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    request_id: str
    params: SamplingParams
    generator: torch.Generator
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS and stop tokens before `min_tokens`


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [S, V] float32, one row per entry of `rows`."""
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    tokens = logits.argmax(dim=-1).tolist()  # greedy for every row; random rows overwrite
    for i, row in enumerate(rows):
        if not row.params.is_greedy:
            tokens[i] = _sample_row(logits[i], row.params, row.generator)
    logprobs = [_logprobs(logits[i], tokens[i], row.params.logprobs) if row.params.logprobs is not None
                else None for i, row in enumerate(rows)]
    return tokens, logprobs


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    scaled = logits / params.temperature  # [V]
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already cover top_p (the first always stays)
        drop = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _logprobs(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    """Log-probabilities of the raw model distribution (before temperature), as vLLM reports."""
    logprobs = logits.log_softmax(-1)
    sampled = float(logprobs[token])
    rank = int((logprobs > sampled).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))  # N may exceed the vocab
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token, sampled, rank, top)
