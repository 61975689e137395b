"""Turn a step's logits into next tokens, for the whole batch at once.

Order, as in transformers' `generate` (the correctness oracle): tokens a request may not produce yet
(EOS before `min_tokens`) and tokens its grammar forbids are masked; `logit_bias` is added; the
repetition, frequency and presence penalties are applied; greedy rows take the argmax; random rows
are scaled by their temperature, then cut by top-k, top-p and min-p, and sampled with their own
generator. Every stage is one tensor operation over the rows that use it (a row at its neutral
value is not touched), never a Python loop over the vocabulary. Logprobs are those of the model's
distribution before penalties, bias, grammar and temperature, as vLLM reports by default.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbaton.kernels.argmax import argmax_rows_kernel
from kvbaton.sched.outputs import TokenLogprobs
from kvbaton.sched.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    request_id: str
    params: SamplingParams
    generator: torch.Generator
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS and stop tokens before `min_tokens`
    prompt_token_ids: Sequence[int] = ()  # for the repetition penalty (with the generated ones)
    generated_token_ids: Sequence[int] = ()  # output so far (an earlier attempt's included)


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None, fallback_token: int = 0,
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [S, V] float32, one row per entry of `rows` (changed in place). `grammar_mask`: the
    rows that follow a grammar, and their token bitmask [G, ceil(V/32)] int32 (bit set: allowed).
    `fallback_token` (EOS) is what a row takes when its masks leave it no token at all."""
    _mask_banned(logits, rows)
    wants_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw = logits[wants_logprobs].clone() if wants_logprobs else None
    if grammar_mask is not None:
        apply_token_bitmask(logits, *grammar_mask)
        # NOTE: a finished grammar allows only EOS, which `min_tokens` may ban: nothing is left, and a softmax
        # over nothing is NaN, which would fail the whole batch. Such a row ends instead.
        stuck = ~torch.isfinite(logits.amax(dim=1))
        if bool(stuck.any()):
            logits[stuck] = float("-inf")
            logits[stuck, fallback_token] = 0.0
    add_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    tokens = greedy_tokens(logits)  # for every row; random rows overwrite
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        for i, token in zip(random_rows, _sample_random(logits[random_rows], [rows[i] for i in random_rows])):
            tokens[i] = token
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw is not None:
        top_ns = [rows[i].params.logprobs or 0 for i in wants_logprobs]
        for i, entry in zip(wants_logprobs, token_logprobs(raw, [tokens[i] for i in wants_logprobs], top_ns)):
            logprobs[i] = entry
    return tokens, logprobs


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as torch.argmax picks it (in C where the kernels are built: ~29 us a row less)."""
    kernel = argmax_rows_kernel()
    if kernel is not None and kernel.handles(logits) and logits.shape[0] and logits.shape[1]:
        return kernel(logits)
    return logits.argmax(dim=-1).tolist()


def apply_token_bitmask(logits: torch.Tensor, row_ids: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens whose bit is clear to -inf, on rows `row_ids` (bit j of word w is token
    32w + j, llguidance's and xgrammar's layout).

    Each mask byte picks its 8 tokens' additive 0 / -inf row from a 256-entry table: one gather and one
    indexed add. For 16 rows of a 49k vocabulary that is 0.65 ms on one Xeon core, where unpacking the bits
    with shifts and a masked fill took 9.7 ms (benchmarks/results/grammar-engines.md)."""
    vocab = logits.shape[1]
    # NOTE: bytes in memory order: on a little-endian CPU (x86, Arm) byte k of word w holds its bits 8k..8k+7
    by_byte = bitmask.contiguous().view(torch.uint8).flatten().long()
    additive = _byte_table(logits.dtype).index_select(0, by_byte).view(len(row_ids), -1)  # [G, 32 * words]
    if additive.shape[1] < vocab:  # a tokenizer smaller than the model's embedding: the rest never allowed
        additive = torch.nn.functional.pad(additive, (0, vocab - additive.shape[1]), value=float("-inf"))
    logits.index_add_(0, row_ids, additive[:, :vocab])


@functools.cache
def _byte_table(dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row b is 0 where bit j of b is set, else -inf (a constant, built once per dtype)."""
    assert sys.byteorder == "little", "the bitmask's bytes are read in little-endian order"
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))


def _mask_banned(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    pairs = [(i, t) for i, row in enumerate(rows) for t in row.banned_token_ids]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long)
        logits[index[:, 0], index[:, 1]] = float("-inf")


def add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    entries = [(i, t, b) for i, row in enumerate(rows) for t, b in (row.params.logit_bias or {}).items()]
    if entries:
        row_ids = torch.tensor([e[0] for e in entries], dtype=torch.long)
        cols = torch.tensor([e[1] for e in entries], dtype=torch.long)
        logits.index_put_((row_ids, cols), torch.tensor([e[2] for e in entries], dtype=logits.dtype), accumulate=True)


def _token_matrix(histories: list[Sequence[int]], vocab: int) -> torch.Tensor:
    """[P, L] token ids, each history padded with `vocab` (an extra, discarded column)."""
    width = max((len(h) for h in histories), default=0)
    ids = torch.full((len(histories), max(width, 1)), vocab, dtype=torch.long)
    for i, h in enumerate(histories):
        if h:
            ids[i, : len(h)] = torch.as_tensor(h, dtype=torch.long)
    return ids


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalized:
        return
    vocab = logits.shape[1]
    sub = logits[penalized]
    params = [rows[i].params for i in penalized]
    generated = _token_matrix([rows[i].generated_token_ids for i in penalized], vocab)
    counts = torch.zeros(len(penalized), vocab + 1, dtype=sub.dtype).scatter_add_(
        1, generated, torch.ones_like(generated, dtype=sub.dtype))[:, :vocab]  # [P, V]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype).unsqueeze(1)
    if bool((repetition != 1.0).any()):
        prompt = _token_matrix([rows[i].prompt_token_ids for i in penalized], vocab)
        seen = torch.zeros(len(penalized), vocab + 1, dtype=torch.bool).scatter_(1, prompt, True)[:, :vocab]
        seen |= counts > 0
        # transformers' RepetitionPenaltyLogitsProcessor: shrink a seen token's logit towards 0 either side
        sub = torch.where(seen, torch.where(sub < 0, sub * repetition, sub / repetition), sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    logits[penalized] = sub


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [R, V] of the random rows."""
    probs = warped_logits(logits, [row.params for row in rows]).softmax(-1)
    # NOTE: one multinomial per row: each request's seeded generator must draw only its own numbers.
    return [int(torch.multinomial(probs[i], 1, generator=row.generator).item()) for i, row in enumerate(rows)]


def warped_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (transformers' warpers, in its order): the logits a random
    row samples from, the cut tokens at -inf. logits: [R, V], one row per entry of `params`."""
    scaled = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    vocab = scaled.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=scaled.dtype)
    if not bool((top_k < vocab).any() or (top_p < 1.0).any() or (min_p > 0.0).any()):
        return scaled
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab).unsqueeze(0)
    # top-k keeps ties with the k-th value, as transformers' TopKLogitsWarper does
    kth = ordered.gather(1, (top_k - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    # top-p: drop a token once the tokens before it already cover top_p (the first always stays). Rows at
    # top_p = 1 are left alone: their rounded cumulative sum can reach 1 before the last token.
    drop = (probs.cumsum(-1) - probs >= top_p.unsqueeze(1)) & (rank > 0) & (top_p < 1.0).unsqueeze(1)
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(-1)
    # min-p: drop tokens below min_p x the most likely one's probability (which itself always stays)
    ordered = ordered.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ordered)


def token_logprobs(raw: torch.Tensor, tokens: list[int], top_ns: list[int]) -> list[TokenLogprobs]:
    """Log-probabilities of the model's distribution (before temperature and processors), as vLLM reports."""
    logprobs = raw.log_softmax(-1)  # [L, V]
    chosen = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
    sampled = logprobs.gather(1, chosen)  # [L, 1]
    ranks = ((logprobs > sampled).sum(dim=1) + 1).tolist()
    top_n = min(max(top_ns, default=0), logprobs.shape[1])  # N may exceed the vocab
    values, ids = torch.topk(logprobs, top_n)
    out = []
    for i, (token, n) in enumerate(zip(tokens, top_ns)):
        top = list(zip(ids[i, :n].tolist(), values[i, :n].tolist())) if n > 0 else []
        out.append(TokenLogprobs(token, float(sampled[i, 0]), ranks[i], top))
    return out
