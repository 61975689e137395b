"""The runner's side of structured outputs: one matcher per request, caught up from its tokens, and one
batched token bitmask per step.

A matcher never learns a token at sampling time: before each step it consumes whatever the request
has generated since it last looked. So the state is always a function of the request's tokens, and
it is rebuilt the same way wherever the request goes: on a decode worker after the prefill worker
sampled the first token, after a preemption, and on a new worker after a failover (whose prompt ends
with the earlier attempt's output, `SamplingParams.resumed_output_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import torch

from kvbaton.engine.structured.grammar import GrammarCompiler
from kvbaton.sched.grammar_spec import StructuredOutput


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int | None = None) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._states: dict[str, _State] = {}
        # NOTE: masks of a batch's rows are computed in parallel in Rust, outside the GIL.
        self._executor = llguidance.LLExecutor(num_threads=num_threads)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def bitmask(self, rows: Sequence[tuple[str, StructuredOutput, Sequence[int]]],
                batch_rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: (request id, spec, tokens generated so far) of each grammar row, and `batch_rows` their
        rows in the step's logits. Returns (row ids, bitmask [G, ceil(V/32)] int32)."""
        mask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)  # every bit: allowed
        live: list[tuple[llguidance.LLMatcher, int]] = []
        for i, (request_id, spec, generated) in enumerate(rows):
            matcher = self._caught_up(request_id, spec, generated)
            if matcher.is_error():
                # NOTE: a token the grammar refused (a state lost) or a grammar out of fuel: the request
                # can only end, and it ends well-formed so far rather than wandering off.
                self._only_eos(mask[i])
            else:
                live.append((matcher, i))
        if live:
            # NOTE: the executor's own call, not `llguidance.torch`'s wrapper: importing that module imports
            # torch.compile's machinery (~2.5 s of every worker's start) for a kernel kvbaton does not use.
            self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), mask.shape[1] * 4, len(rows))
        return torch.tensor(batch_rows, dtype=torch.long), mask

    def _caught_up(self, request_id: str, spec: StructuredOutput, generated: Sequence[int]) -> llguidance.LLMatcher:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _State(self.compiler.matcher(spec))
        if state.num_consumed < len(generated):
            new = list(generated[state.num_consumed:])
            if state.matcher.is_stopped():
                pass  # the grammar is complete: what follows (EOS, with ignore_eos more) is not its business
            else:
                state.matcher.consume_tokens([t for t in new if t not in self.eos_token_ids])
            state.num_consumed = len(generated)
        return state.matcher

    def _only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        for token in self.eos_token_ids:
            bit = token % 32
            row[token // 32] |= -(2**31) if bit == 31 else 1 << bit  # int32: bit 31 is the sign
