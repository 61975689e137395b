"""A request's whole life inside one engine: its tokens, its progress, and how it ended."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

from kvbaton.sched.outputs import FinishReason, RemoteDecode, TokenLogprobs
from kvbaton.sched.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # A prefill worker's request whose KV is on its way to a decode worker: done here, blocks
    # held until the transfer ends. The client's request goes on elsewhere.
    FINISHED_TRANSFERRED = "transfer"
    WAITING_FOR_KV = "waiting_for_kv"  # a decode worker's request whose KV is being received

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_TRANSFERRED)


@dataclass(frozen=True)
class ImageSpan:
    """An image in a prompt: `length` positions from `start`, its placeholder tokens, whose embeddings the image
    encoder supplies (in order), and with `runs`, the text tokens between its runs too; `digest` (its decoded
    pixels' hash) tells it from any other image in the KV blocks' content hashes, since its placeholder tokens
    are the same for every image."""

    start: int
    length: int
    digest: bytes
    runs: tuple[tuple[int, int], ...] = ()  # (start, length) of each placeholder run when there are several
    grid: tuple[int, ...] = ()  # Qwen2-VL: the (rows, columns) its placeholders fill (multimodal positions)

    @property
    def placeholder_runs(self) -> tuple[tuple[int, int], ...]:
        return self.runs or ((self.start, self.length),)

    @property
    def rows(self) -> int:
        """How many embeddings the image's placeholders take."""
        return sum(n for _, n in self.placeholder_runs)

    def placements(self) -> list[tuple[int, int, int]]:
        """(position, first embedding row, rows) of each run: the image's embeddings fill its runs in order."""
        out, row = [], 0
        for start, n in self.placeholder_runs:
            out.append((start, row, n))
            row += n
        return out


def digests_between(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The digests of the images of `spans` with a placeholder at positions [start, end), in order (b"": none):
    what a KV block's content hash chains besides its tokens (`kv.hashing.hash_block_tokens`)."""
    return b"".join(s.digest for s in spans if s.start < end and start < s.start + s.length)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    _: KW_ONLY
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower value is served first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    first_scheduled_time: float | None = None
    remote_decode: RemoteDecode | None = None  # prefill role: hand the KV off after the prompt
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # as computed (prompt tokens 1, 2, ...)
    image_spans: tuple[ImageSpan, ...] = ()  # in prompt order

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying both."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def image_digests(self, start: int, end: int) -> bytes:
        """The digests of the images with a placeholder at positions [start, end), in order (b"": none)."""
        return digests_between(self.image_spans, start, end)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason(self.status.value) if self.is_finished else None
