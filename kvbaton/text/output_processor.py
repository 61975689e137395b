"""Engine-core outputs -> user-facing `RequestOutput`s: detokenize, stop strings, logprobs.

Text that might be the beginning of a stop string is held back from `delta_text` until it
is known not to be, so a stream never shows a stop string it later has to take back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from kvbaton.sched.outputs import EngineCoreOutput, FinishReason, TokenLogprobs
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.logprob_columns import LogprobColumns, LogprobsView, PromptLogprobsView
from kvbaton.text.request_output import CompletionOutput, RequestMetrics, RequestOutput
from kvbaton.text.tokenizer import Tokenizer


@dataclass(kw_only=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    decoder: DecodeStream
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_text_sent: int = 0
    num_tokens_sent: int = 0
    logprobs: LogprobColumns | None = None
    cumulative_logprob: float | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    stop_string: str | None = None
    prompt_logprobs: PromptLogprobsView | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        decoder = self.tokenizer.decode_stream(params.skip_special_tokens)
        state = _RequestState(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
                              decoder=decoder, arrival_time=arrival_time)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = LogprobColumns(), 0.0
        self._states[request_id] = state

    def process(self, output: EngineCoreOutput) -> tuple[RequestOutput, str | None]:
        """Returns the user-facing output and, if a stop string ended it, that string
        (the caller then stops the request in the scheduler)."""
        state = self._states[output.request_id]
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
            state.first_scheduled_time = output.first_scheduled_time
            state.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None and state.prompt_logprobs is None:
            columns = LogprobColumns()
            for entry in output.prompt_logprobs:
                columns.append(entry)
            state.prompt_logprobs = PromptLogprobsView(columns, self.tokenizer.token_text)
        # NOTE: users see plain strings, as vLLM's `finish_reason` (str() of a str-enum is its name)
        finish_reason = None if output.finish_reason is None else output.finish_reason.value
        stop_reason = output.stop_reason
        entries: Sequence[TokenLogprobs | None] = output.logprobs or [None] * len(output.new_token_ids)
        cut = False  # a stop string ended the request before this output's last token
        for token, logprobs in zip(output.new_token_ids, entries):
            if state.stop_string is not None:
                cut = True  # a decode burst's tokens past the stop string: single steps would have stopped there
                break
            state.token_ids.append(token)
            self._append_logprobs(state, logprobs)
            self._append_text(state, token)
        if state.stop_string is not None and (cut or finish_reason in (None, FinishReason.LENGTH.value)):
            finish_reason, stop_reason = FinishReason.STOP.value, state.stop_string
        return self._build(state, finish_reason, stop_reason), state.stop_string

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        return None if state is None else self._build(state, FinishReason.ABORT.value, None)

    def _append_text(self, state: _RequestState, token: int) -> None:
        piece = state.decoder.step(self.tokenizer.backend, token)
        if not piece:
            return
        start = max(0, len(state.text) - self._max_stop_len(state) + 1)
        state.text += piece
        found = [(state.text.find(s, start), s) for s in state.params.stop_strings]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            index, stop = min(found)
            end = index + len(stop) if state.params.include_stop_str_in_output else index
            state.text, state.stop_string = state.text[:end], stop

    def _append_logprobs(self, state: _RequestState, entry: TokenLogprobs | None) -> None:
        if state.logprobs is None or state.cumulative_logprob is None or entry is None:
            return
        state.logprobs.append(entry)
        state.cumulative_logprob += entry.logprob

    def _build(self, state: _RequestState, finish_reason: str | None, stop_reason: int | str | None) -> RequestOutput:
        finished = finish_reason is not None
        releasable = len(state.text) if finished else max(
            state.num_text_sent, len(state.text) - self._max_stop_len(state) + 1)
        delta_text = state.text[state.num_text_sent:releasable]
        delta_tokens = state.token_ids[state.num_tokens_sent:]
        state.num_text_sent, state.num_tokens_sent = releasable, len(state.token_ids)
        completion = CompletionOutput(
            index=0, text=state.text, token_ids=list(state.token_ids),
            cumulative_logprob=state.cumulative_logprob,
            # NOTE: a view of the positions so far, not a copy: the columns only grow (see logprob_columns)
            logprobs=None if state.logprobs is None else LogprobsView(state.logprobs, len(state.logprobs),
                                                                      self.tokenizer.token_text),
            finish_reason=finish_reason, stop_reason=stop_reason,
            delta_text=delta_text, delta_token_ids=delta_tokens,
        )
        metrics = RequestMetrics(arrival_time=state.arrival_time, first_token_time=state.first_token_time,
                                 finished_time=time.monotonic() if finished else None,
                                 num_cached_tokens=state.num_cached_tokens,
                                 first_scheduled_time=state.first_scheduled_time)
        if finished:
            del self._states[state.request_id]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], finished, metrics,
                             state.prompt_logprobs)

    @staticmethod
    def _max_stop_len(state: _RequestState) -> int:
        return max((len(s) for s in state.params.stop_strings), default=1)
