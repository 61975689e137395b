"""Build OpenAI-shaped response bodies and stream chunks from `RequestOutput`s."""

from __future__ import annotations

import json
import time

from kvbaton.engine.request_output import CompletionOutput, Logprob, RequestOutput


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(out: RequestOutput) -> dict:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    cached = out.metrics.num_cached_tokens if out.metrics else 0
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


class ResponseBuilder:
    """One request's response shape: completions or chat, streamed or whole."""

    def __init__(self, kind: str, request_id: str, model: str, top_logprobs: int | None) -> None:
        self.kind, self.id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.top_logprobs = top_logprobs
        self._logprobs_sent = 0
        self._text_sent = 0

    def _logprobs(self, c: CompletionOutput, entries: list[dict[int, Logprob]]) -> dict | None:
        if c.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.top_logprobs or 0)
        return completion_logprobs(entries, self.top_logprobs or 0, self._text_sent)

    def full(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        choice = {"index": 0, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                  "logprobs": self._logprobs(c, c.logprobs or [])}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(out), "kvbaton_timing": timing(out)}

    def chunk(self, out: RequestOutput | None, first: bool = False) -> dict:
        """A stream chunk for the latest delta (or, with `first`, chat's role-only chunk)."""
        choice: dict = {"index": 0, "finish_reason": None, "logprobs": None}
        delta = ""
        if out is not None:
            c = out.outputs[0]
            new_entries = (c.logprobs or [])[self._logprobs_sent:]
            choice["logprobs"] = self._logprobs(c, new_entries)
            self._logprobs_sent = len(c.logprobs or [])
            choice["finish_reason"] = c.finish_reason
            if c.finish_reason:
                choice["stop_reason"] = c.stop_reason
            delta = c.delta_text
            self._text_sent += len(delta)
        if self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": ""} if first else {"content": delta}
            obj = "chat.completion.chunk"
        else:
            choice["text"] = delta
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, out: RequestOutput) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(out), "kvbaton_timing": timing(out)}
