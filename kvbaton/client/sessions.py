"""What `kvbaton chat` and `kvbaton complete` send: a conversation that keeps its history, or one prompt at a time.

Each answer is written piece by piece as it streams, then a newline: a person sees it being
written, and a pipe reads one answer per turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from kvbaton.client.endpoint import Endpoint


@dataclass(frozen=True)
class Sampling:
    """The model and the sampling fields sent with every request; None: the server's default."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None

    def fields(self) -> dict[str, Any]:
        optional = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        return {"model": self.model, **{k: v for k, v in optional.items() if v is not None}}


@dataclass(frozen=True, kw_only=True)
class Session:
    """One endpoint and model, and where the answers go."""

    endpoint: Endpoint
    http: httpx.Client
    sampling: Sampling
    out: TextIO

    def complete(self, prompt: str) -> str:
        return self._answer("/completions", {"prompt": prompt})

    def chat(self, messages: list[dict[str, str]]) -> str:
        return self._answer("/chat/completions", {"messages": messages})

    def _answer(self, path: str, body: dict[str, Any]) -> str:
        return _written(self.endpoint.stream(self.http, path, {**self.sampling.fields(), **body}), self.out)


@dataclass
class Conversation:
    """The messages so far; a turn joins them once its answer has fully arrived (a failed turn is not kept)."""

    session: Session
    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, session: Session, system: str | None = None) -> Conversation:
        return cls(session, [{"role": "system", "content": system}] if system else [])

    def say(self, text: str) -> str:
        turn = [*self.messages, {"role": "user", "content": text}]
        answer = self.session.chat(turn)
        self.messages = [*turn, {"role": "assistant", "content": answer}]
        return answer


def _written(pieces: Iterator[str], out: TextIO) -> str:
    parts = []
    for piece in pieces:
        out.write(piece)
        out.flush()
        parts.append(piece)
    out.write("\n")
    out.flush()
    return "".join(parts)
