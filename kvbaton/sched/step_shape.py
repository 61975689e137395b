"""What a step costs a cost model: the shape of a scheduled batch (prompt tokens, decoding sequences, the
context each attends to), never its token ids.

It lives with the engine because the engine reports it (`step_trace.py`: each served step's shape and
seconds); the simulator's step-latency models (`kvbaton.sim.latency`) turn it into seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvbaton.sched.outputs import ScheduledRequest


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

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill_tokens and self.decode_seqs else "prefill" if self.prefill_tokens else "decode"

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
