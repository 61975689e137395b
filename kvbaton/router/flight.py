"""The router's record of one client request, from arrival to last byte, across attempts.

The router owns the request: it knows every token the client has been sent, so when a worker
dies it can start a new *attempt* elsewhere from prompt + those tokens and the stream goes on
with nothing duplicated and nothing missing. Messages name attempts (`<request id>#<n>`), so
late output of an abandoned attempt is recognised and dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from dataclasses import dataclass, field

from kvbaton.messages.router_worker import ImageEmbedding, ImagePixels
from kvbaton.sched.request import ImageSpan
from kvbaton.sched.sampling_params import SamplingParams


class Phase(enum.Enum):
    ENCODING = "encoding"  # an encoder worker encodes its images (E/P/D); its KV has no worker yet
    PREPARING = "preparing"  # asked the decode worker to reserve blocks
    PREFILLING = "prefilling"  # the prefill worker computes the prompt and sends the KV
    DECODING = "decoding"  # on the decode worker (after a transfer, or prefilled locally)


@dataclass(kw_only=True)
class Flight:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    queue: asyncio.Queue
    tokens: list[int] = field(default_factory=list)  # every token already given to the client
    attempt: int = 0
    phase: Phase = Phase.DECODING
    prefill: str | None = None  # worker names of the current attempt
    decode: str | None = None
    num_cached_tokens: int | None = None  # from the first attempt; what `usage` reports
    finished: bool = False  # the client has its last output: late outputs of the attempt are dropped
    failures: int = 0  # attempts that ended in a step that raised on it, or with their worker's death
    last_progress: float = field(default_factory=time.monotonic)  # arrival, then each output's arrival
    resuming: bool = False  # an attempt that continues a stream: its first output says what it restored
    images: tuple[ImagePixels, ...] = ()  # those whose placeholders the prompt holds (each attempt sends them)
    image_spans: tuple[ImageSpan, ...] = ()  # where their placeholders are (the prefix-aware policy hashes them)
    encoder: str | None = None  # the encoder worker encoding them now
    # their embeddings, once an encoder worker sent them, until the prompt is computed: the attempt sends these
    # instead of the pixels (a later attempt has them encoded again)
    embeddings: tuple[ImageEmbedding, ...] = ()

    def resume_costs(self, num_cached_tokens: int) -> tuple[int, int]:
        """(context tokens the resumed attempt found cached, tokens it recomputed), as of its first output."""
        context = len(self.prompt_token_ids) + len(self.tokens)
        return num_cached_tokens, max(context - num_cached_tokens, 0)

    @property
    def attempt_id(self) -> str:
        return f"{self.request_id}#{self.attempt}"

    def next_attempt(self) -> None:
        self.attempt += 1
        self.prefill = self.decode = self.encoder = None
        self.resuming = bool(self.tokens)

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """Prompt and params that produce the rest of the output: the tokens the client already
        has become part of the prompt, and the limits shrink by as many. The worker is told how many
        of the prompt's tokens are output, so penalties count them and a grammar has matched them."""
        done = len(self.tokens)
        if not done:
            return self.prompt_token_ids, self.params
        params = self.params
        max_tokens = None if params.max_tokens is None else params.max_tokens - done
        params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - done),
                                     resumed_output_tokens=done, prompt_logprobs=None)  # the client has them
        return self.prompt_token_ids + self.tokens, params
