"""The dataclasses that cross the scheduler <-> model runner boundary (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvbaton.engine.sampling_params import SamplingParams
from kvbaton.kv.layout import KVLayout


class RemoteDecode(msgspec.Struct, frozen=True):
    """On a prefill worker: where this request's KV goes once its prompt is computed.

    The decode worker already holds the first `skip_blocks` blocks of the prompt (its own
    prefix-cache hit); the rest go into its `dst_block_ids`, in order."""

    receiver: str
    dst_block_ids: list[int]
    skip_blocks: int
    layout: KVLayout  # the receiver's: the sender refuses a mismatch
    deadline_s: float = 30.0


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions from `start_position`."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool  # the chunk reaches the request's last token, so a next token is sampled
    sampling_params: SamplingParams
    num_output_tokens: int  # before this step; seeds per-request sampling state
    remote_decode: RemoteDecode | None = None  # prefill worker: send the prompt's KV when this chunk ends it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_request_ids: frozenset[str]  # done since the last step: the runner drops their state
    num_scheduled_tokens: int
    preempted_request_ids: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one generated position: the sampled token's and the top N."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class ModelOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when it left the waiting queue
