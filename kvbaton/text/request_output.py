"""Results handed to users, shaped like vLLM's `RequestOutput` so code can switch over."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, Logprob]] | None = None  # per output position (`logprob_columns`: rendered when read)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    delta_text: str = ""  # text released by the latest step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # vLLM's: per prompt token, its logprob and the top N (None for the first token, which nothing predicts)
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = None
