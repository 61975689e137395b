"""Build OpenAI-shaped response bodies and stream chunks from `RequestOutput`s."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvbaton.text.request_output import CompletionOutput, Logprob, RequestOutput


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


def completion_logprobs(entries: Sequence[dict[int, Logprob]], top_n: int, start_offset: int) -> dict:
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


def echoed_logprobs(prompt: str, entries: Sequence[dict[int, Logprob] | None], top_n: int, generated: dict) -> dict:
    """The legacy completions logprobs with an echoed `prompt` in front of the `generated` ones: the prompt's
    first token has none (nothing predicts it), and its text is what the others' texts leave of the prompt."""
    predicted = [e for e in entries[1:] if e is not None]  # rendered once (`logprob_columns`)
    rest = [next(iter(e.values())) for e in predicted]
    first = prompt[: max(0, len(prompt) - sum(len(lp.decoded_token or "") for lp in rest))]
    tokens, offsets, offset = [first], [0], len(first)
    token_lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for entry, chosen in zip(predicted, rest):
        tokens.append(chosen.decoded_token or "")
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in _top(entry, top_n)})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {key: value + generated[key] for key, value in (("tokens", tokens), ("token_logprobs", token_lps),
                                                          ("top_logprobs", tops), ("text_offset", offsets))}


def prompt_logprobs_json(entries: Sequence[dict[int, Logprob] | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} (None first)."""
    if entries is None:
        return None
    return [None if e is None else {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                                  "decoded_token": lp.decoded_token} for token, lp in e.items()}
            for e in entries]


def chat_logprobs(entries: Sequence[dict[int, Logprob]], top_n: int) -> dict:
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
    prompt_logprobs_sent: bool = False


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

    def _logprobs(self, c: CompletionOutput, entries: Sequence[dict[int, Logprob]], text_offset: int,
                  echoed: tuple[str, RequestOutput] | None = None) -> dict | None:
        """`echoed`: the echoed prompt and the output carrying its logprobs, put in front of the generated ones."""
        if c.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.top_logprobs or 0)
        generated = completion_logprobs(entries, self.top_logprobs or 0, text_offset)
        if echoed is None or echoed[1].prompt_logprobs is None:
            return generated
        return echoed_logprobs(echoed[0], echoed[1].prompt_logprobs, self.top_logprobs or 0, generated)

    def _echoed(self, index: int) -> str:
        return self.echo[index] if self.echo is not None else ""

    def body_entries(self, outs: list[tuple[int, RequestOutput]]) -> int:
        """About how many logprob entries (and tokens) a whole response of `outs` renders: what its build costs."""
        per_token = 1 + (self.top_logprobs or 0)
        return sum(len(out.outputs[0].token_ids) + len(out.outputs[0].logprobs or ()) * per_token
                   + len(out.prompt_logprobs or ()) * per_token for _, out in outs)

    def full(self, outs: list[tuple[int, RequestOutput]],
             messages: dict[int, tuple[dict, str | None]] | None = None) -> dict:
        """The whole response; `messages` replaces a chat choice's message and finish_reason (tool calls
        parsed out of its text)."""
        choices = []
        for index, out in sorted(outs, key=lambda item: item[0]):
            c = out.outputs[0]
            echoed = self._echoed(index)
            choice: dict = {"index": index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "logprobs": self._logprobs(c, c.logprobs or [], len(echoed),
                                                 (echoed, out) if self.echo is not None else None)}
            if out.prompt_logprobs is not None and self.kind != "chat":
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            if self.kind == "chat" and messages is not None and index in messages:
                choice["message"], choice["finish_reason"] = messages[index]
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = echoed + c.text
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body: dict = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(outs, self.n), "kvbaton_timing": timing(_last(outs))}
        if self.kind == "chat" and outs and outs[0][1].prompt_logprobs is not None:  # vLLM's place for chat
            body["prompt_logprobs"] = prompt_logprobs_json(outs[0][1].prompt_logprobs)
        return body

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
        echoed = None
        if not state.started:
            text = self._echoed(index) + text
            state.text_sent += len(self._echoed(index))
            state.started = True
            echoed = (self._echoed(index), out) if self.echo is not None else None
        choice: dict = {"index": index, "finish_reason": c.finish_reason,
                        "logprobs": self._logprobs(c, new_entries, state.text_sent, echoed)}
        if echoed is None and not state.prompt_logprobs_sent and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        state.prompt_logprobs_sent = state.prompt_logprobs_sent or out.prompt_logprobs is not None
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
