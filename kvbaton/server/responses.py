"""Build OpenAI-shaped response bodies and stream chunks from `RequestOutput`s."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kvbaton.engine.request_output import CompletionOutput, Logprob, RequestOutput


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(outs: list[tuple[int, RequestOutput]], n: int = 1) -> dict:
    """One request's usage over its choices (`index`, output): each prompt counted once (its n choices
    share it, as OpenAI counts), every choice's generated tokens counted."""
    by_prompt = {index // n: out for index, out in sorted(outs, key=lambda item: item[0], reverse=True)}
    n_prompt = sum(len(out.prompt_token_ids) for out in by_prompt.values())
    n_out = sum(len(out.outputs[0].token_ids) for _, out in outs)
    cached = sum(out.metrics.num_cached_tokens for out in by_prompt.values() if out.metrics)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timing(out: RequestOutput) -> dict:
    """Request-level timing (kvbaton extension field; OpenAI clients keep unknown fields)."""
    m = out.metrics
    if m is None:
        return {}
    end = m.finished_time or time.monotonic()
    return {"ttft_s": m.ttft, "queue_time_s": m.queue_time, "e2e_s": end - m.arrival_time}


def _top(entry: dict[int, Logprob], top_n: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank or 0)[:top_n]


def completion_logprobs(entries: list[dict[int, Logprob]], top_n: int, start_offset: int) -> dict:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], start_offset
    for entry in entries:
        sampled = next(iter(entry.values()))  # the sampled token is always first
        tokens.append(sampled.decoded_token or "")
        token_lps.append(sampled.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in _top(entry, top_n)})
        offsets.append(offset)
        offset += len(sampled.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[dict[int, Logprob]], top_n: int) -> dict:
    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for entry in entries:
        sampled = next(iter(entry.values()))
        content.append({**item(sampled), "top_logprobs": [item(lp) for lp in _top(entry, top_n)]})
    return {"content": content}


@dataclass
class _ChoiceState:
    """What one choice's stream has sent so far."""

    logprobs_sent: int = 0
    text_sent: int = 0
    started: bool = False


class ResponseBuilder:
    """One request's response shape: completions or chat, streamed or whole, with one choice per
    prompt x n (choice `index` = prompt index * n + sample index, as OpenAI and vLLM number them).
    `echo`: per choice, the prompt text that completions put before the generated text."""

    def __init__(self, kind: str, request_id: str, model: str, top_logprobs: int | None,
                 echo: list[str] | None = None, n: int = 1) -> None:
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.created = int(time.time())
        self.top_logprobs = top_logprobs
        self.echo = echo
        self._choices: dict[int, _ChoiceState] = {}

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _state(self, index: int) -> _ChoiceState:
        return self._choices.setdefault(index, _ChoiceState())

    def _logprobs(self, c: CompletionOutput, entries: list[dict[int, Logprob]], text_offset: int) -> dict | None:
        if c.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.top_logprobs or 0)
        return completion_logprobs(entries, self.top_logprobs or 0, text_offset)

    def _echoed(self, index: int) -> str:
        return self.echo[index] if self.echo is not None else ""

    def full(self, outs: list[tuple[int, RequestOutput]],
             messages: dict[int, tuple[dict, str | None]] | None = None) -> dict:
        """The whole response; `messages` replaces a chat choice's message and finish_reason (tool calls
        parsed out of its text)."""
        choices = []
        for index, out in sorted(outs, key=lambda item: item[0]):
            c = out.outputs[0]
            echoed = self._echoed(index)
            choice = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "logprobs": self._logprobs(c, c.logprobs or [], len(echoed))}
            if self.kind == "chat" and messages is not None and index in messages:
                choice["message"], choice["finish_reason"] = messages[index]
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = echoed + c.text
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(outs, self.n), "kvbaton_timing": timing(_last(outs))}

    def role_chunk(self, index: int) -> dict:
        """Chat's first chunk of a choice: the role, no content."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                  "logprobs": None}
        return self._wrap(choice)

    def chunk(self, index: int, out: RequestOutput, delta: dict | None = None) -> dict:
        """A stream chunk for choice `index`'s latest delta; `delta` replaces chat's content delta (tool calls)."""
        state = self._state(index)
        c = out.outputs[0]
        new_entries = (c.logprobs or [])[state.logprobs_sent:]
        text = c.delta_text
        if not state.started:
            text = self._echoed(index) + text
            state.text_sent += len(self._echoed(index))
            state.started = True
        choice: dict = {"index": index, "finish_reason": c.finish_reason,
                        "logprobs": self._logprobs(c, new_entries, state.text_sent)}
        state.logprobs_sent = len(c.logprobs or [])
        if c.finish_reason:
            choice["stop_reason"] = c.stop_reason
        state.text_sent += len(c.delta_text)
        if self.kind == "chat":
            choice["delta"] = delta if delta is not None else {"content": text}
        else:
            choice["text"] = text
        return self._wrap(choice)

    def delta_chunk(self, index: int, delta: dict, finish_reason: str | None = None,
                    stop_reason: int | str | None = None) -> dict:
        """A chat chunk with this `delta` (a tool call's parts, or content the tool parser released)."""
        choice: dict = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        if finish_reason:
            choice["stop_reason"] = stop_reason
        return self._wrap(choice)

    def _wrap(self, choice: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, outs: list[tuple[int, RequestOutput]]) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(outs, self.n), "kvbaton_timing": timing(_last(outs))}


def _last(outs: list[tuple[int, RequestOutput]]) -> RequestOutput:
    """The choice that finished last: the request's timing is its."""
    return max((out for _, out in outs), key=lambda o: (o.metrics.finished_time or 0.0) if o.metrics else 0.0)
