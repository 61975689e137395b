"""What a step costs: the shape of a scheduled batch, and the models that turn it into seconds.

A step-latency model stands in for the model runner. It sees only the step's shape (how many
prompt tokens, how many decoding sequences, how much context each attends to), never token ids,
so one model serves every workload. Implementations: a fit to this machine's measured steps
(`profiled.py`), and a roofline of a hardware preset (`roofline.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvbaton.engine.outputs import ScheduledRequest


@dataclass(frozen=True)
class StepShape:
    """One step's batch, as a cost model sees it.

    A scheduled request is *decoding* when it computes one token past its prompt; anything else
    (a prompt chunk, or a preempted request computing prompt + output again) is *prefill*.
    """

    prefill_tokens: int = 0  # tokens computed for prefill chunks, summed
    prefill_seqs: int = 0
    # Sum over every prefill token of the positions it attends to (itself and all before it): a
    # chunk of n tokens after `start` cached ones attends n*start + n(n+1)/2.
    prefill_attended: int = 0
    decode_seqs: int = 0
    decode_context: int = 0  # sum over decoding sequences of the positions each attends to

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0

    @classmethod
    def of(cls, scheduled: Iterable[ScheduledRequest]) -> StepShape:
        prefill_tokens = prefill_seqs = prefill_attended = decode_seqs = decode_context = 0
        for item in scheduled:
            n, start = len(item.token_ids), item.start_position
            if n == 1 and start >= len(item.prompt_token_ids):
                decode_seqs += 1
                decode_context += start + 1
            else:
                prefill_tokens += n
                prefill_seqs += 1
                prefill_attended += n * start + n * (n + 1) // 2
        return cls(prefill_tokens, prefill_seqs, prefill_attended, decode_seqs, decode_context)


class StepLatencyModel(Protocol):
    """Seconds one engine step of `shape` takes on one instance (a worker, or a TP/PP group).

    Contract: deterministic (the same shape always costs the same), positive for a non-empty
    shape, and non-decreasing in every field of the shape."""

    @property
    def name(self) -> str: ...

    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True, kw_only=True)
class LinearLatency:
    """A step costs a fixed part plus a price per token, per attended position and per decoding sequence.

    The simplest model that satisfies the contract (non-negative prices); tests and quick what-ifs
    use it with made-up prices, `profiled.py` fits such prices to measured steps."""

    base_s: float
    per_token_s: float = 0.0
    per_attended_s: float = 0.0  # per position a prefill token attends to
    per_decode_seq_s: float = 0.0
    per_context_s: float = 0.0  # per position a decoding sequence attends to
    label: str = "linear"

    def __post_init__(self) -> None:
        prices = (self.base_s, self.per_token_s, self.per_attended_s, self.per_decode_seq_s, self.per_context_s)
        if min(prices) < 0 or self.base_s <= 0:
            raise ValueError("a linear step-latency model needs a positive base and non-negative prices")

    @property
    def name(self) -> str:
        return self.label

    def step_seconds(self, shape: StepShape) -> float:
        return (self.base_s + self.per_token_s * shape.num_tokens + self.per_attended_s * shape.prefill_attended
                + self.per_decode_seq_s * shape.decode_seqs + self.per_context_s * shape.decode_context)
