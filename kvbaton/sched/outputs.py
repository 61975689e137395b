"""The records that cross the scheduler <-> model runner boundary, and what an engine step gives
back to its caller (no torch here)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from kvbaton.kv.layout import KVLayout
from kvbaton.sched.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request ended in an engine. A `str` enum: equal to its value, and serialised as it."""

    STOP = "stop"  # EOS, a stop token, or (set by the frontend) a stop string
    LENGTH = "length"  # max_tokens, or the context / KV pool is full
    ABORT = "abort"  # cancelled (client gone, worker fenced, ...)
    TRANSFER = "transfer"  # a prefill worker's request: its KV went to a decode worker, which goes on


class RemoteDecode(msgspec.Struct, frozen=True, kw_only=True):
    """On a prefill worker: where this request's KV goes once its prompt is computed.

    The decode worker already holds the first `skip_blocks` blocks of the prompt (its own
    prefix-cache hit); the rest go into its `dst_block_ids`, in order."""

    receiver: str
    dst_block_ids: list[int]
    skip_blocks: int
    layout: KVLayout  # the receiver's: the sender refuses a mismatch
    deadline_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
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
    # NOTE: the request's own lists, not copies (read by the runner before this step's token is appended):
    # penalties and the grammar need the tokens so far, and copying a long context every step would cost.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    prompt_logprobs: int | None = None  # top-N of the prompt tokens this chunk predicts, when asked

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Rows of this chunk whose logits predict a prompt token (positions before the prompt's last)."""
        if self.prompt_logprobs is None:
            return 0
        return max(0, min(self.start_position + self.num_tokens, len(self.prompt_token_ids) - 1) - self.start_position)

    @property
    def generated_token_ids(self) -> Sequence[int]:
        """Output so far, with the earlier attempt's output at the end of the prompt when it resumed."""
        resumed = self.sampling_params.resumed_output_tokens
        if not resumed:
            return self.output_token_ids
        return [*self.prompt_token_ids[len(self.prompt_token_ids) - resumed:], *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_request_ids: frozenset[str]  # done since the last step: the runner drops their state
    num_scheduled_tokens: int
    preempted_request_ids: frozenset[str] = frozenset()
    # >1: a decode burst (sched/burst.py): every request decodes this many tokens, each step's argmax the next
    # step's input; `scheduled` describes the first step
    decode_steps: int = 1

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
class TransferFailure:
    """A KV hand-off that ended without the data (refused at begin, timed out, peer gone, ...)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class ModelOutput:
    # each sampling request's new tokens, in order: one, or a decode burst's (the scheduler takes them up to a
    # stop)
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # prefill role: hand-offs the runner could not begin this step (their requests' blocks are freed)
    failed_transfers: list[TransferFailure] = field(default_factory=list)
    # request id -> (position of the first, logprobs of prompt tokens position + 1, position + 2, ...)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when it left the waiting queue
    prompt_logprobs: list[TokenLogprobs] | None = None  # with a request's first output: prompt tokens 1..n-1


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine gave up on inside a step (the step raised while computing it; its blocks are
    freed), or, not `in_step`, refused before any step (its grammar did not compile: no retry helps)."""

    request_id: str
    reason: str
    in_step: bool = True


@dataclass(frozen=True)
class StepResult:
    """What one engine step gave back: each request's new tokens, (prefill role) the hand-offs that
    could not begin, and the requests of a batch that raised. Callers report the failures before the
    outputs (see `worker.main`)."""

    outputs: list[EngineCoreOutput]
    failed_transfers: list[TransferFailure] = field(default_factory=list)
    failed_requests: list[RequestFailure] = field(default_factory=list)
