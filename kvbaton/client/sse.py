"""Server-Sent Events as OpenAI-compatible servers stream them, and the chunks they carry.

    data: {"choices":[{"text":"Hi"}]}          <- /v1/completions chunk
    data: {"choices":[{"delta":{"content":"Hi"}}]}   <- /v1/chat/completions chunk
    data: {"choices":[],"usage":{...}}          <- last chunk when include_usage is set
    data: [DONE]

Each event ends at a blank line; only the `data` field matters here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import NamedTuple


class StreamEvent(NamedTuple):
    """What one streamed chunk says: new text, the usage block, the end, or an error."""

    text: str = ""
    usage: dict | None = None
    done: bool = False
    error: str | None = None
    finish_reason: str | None = None


class LineSplitter:
    """A text stream's lines, split as SSE splits them: at LF (a CR before it dropped), never at the other
    characters Python's `splitlines` and httpx's `iter_lines` also break at (U+2028, U+0085, ...), which a
    server may send raw inside a JSON string (vLLM does), cutting one event in two."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, chunk: str) -> list[str]:
        *lines, self._rest = (self._rest + chunk).split("\n")
        return [line.removesuffix("\r") for line in lines]

    def finish(self) -> list[str]:
        return [self._rest.removesuffix("\r")] if self._rest else []


def sse_lines(chunks: Iterable[str]) -> Iterator[str]:
    splitter = LineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.finish()


async def asse_lines(chunks: AsyncIterable[str]) -> AsyncIterator[str]:
    """`sse_lines` over an async text stream (httpx's `aiter_text`)."""
    splitter = LineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.finish():
        yield line


class SSEDecoder:
    """Incremental SSE decoder fed one line at a time (line endings already stripped)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The `data` of the event this line completes, else None."""
        if not line:
            return self.flush()
        if line.startswith(":"):  # a comment / keep-alive ping
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """Dispatch a pending event at end of stream (a server may omit the final blank line)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_event(data: str) -> StreamEvent:
    """Decode one event's data; never raises (a malformed chunk becomes an error event)."""
    if data.strip() == "[DONE]":
        return StreamEvent(done=True)
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return StreamEvent(error=f"malformed chunk: {data[:200]!r}")
    if not isinstance(chunk, dict):
        return StreamEvent(error=f"malformed chunk: {data[:200]!r}")
    if chunk.get("error"):
        return StreamEvent(error=_error_message(chunk["error"]))
    choices = chunk.get("choices") or [{}]
    return StreamEvent(text=_choice_text(choices[0]), usage=chunk.get("usage") or None,
                       finish_reason=choices[0].get("finish_reason"))


def _choice_text(choice: dict) -> str:
    if choice.get("text"):
        return choice["text"]
    delta = choice.get("delta") or {}
    # NOTE: reasoning models stream their thinking in a separate field; it is still output tokens.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _error_message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
