"""What a step costs: the shape of a scheduled batch, and the models that turn it into seconds.

A step-latency model stands in for the model runner. It sees only the step's shape (how many
prompt tokens, how many decoding sequences, how much context each attends to), never token ids,
so one model serves every workload. Implementations: a fit to this machine's measured steps
(`profiled.py`), and a roofline of a hardware preset (`roofline.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvbaton.sched.step_shape import StepShape

__all__ = ["LinearLatency", "StepLatencyModel", "StepShape"]  # StepShape lives with the engine, which traces it


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
