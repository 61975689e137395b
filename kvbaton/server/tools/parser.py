"""The contract of a tool-call parser for `tool_choice: "auto"`: the model may answer in text, call
tools in the convention its chat template taught it, or both; a parser splits one from the other.

Parsers know only the convention, not the request's tools: a call to a name that is not among the
tools is still reported (as OpenAI-compatible servers do); the client refuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvbaton.server.tools.calls import ContentDelta, Delta, ParsedOutput, ToolCall, call_deltas
from kvbaton.server.tools.content import ContentShaper


class ToolStreamParser(ABC):
    """One response's output, fed as it is generated (one instance per response).

    Contract: `feed(delta)` returns the deltas that can be sent now; text that may still turn out to
    be part of a call is held back. `finish()` returns the rest once generation has ended, and may
    be called once. For any split of a text into deltas, the content deltas concatenate to
    `parse(text).content` and `calls` equals `parse(text).calls` (ids aside), each call sent as a
    header delta (`index`, `id`, `name`, empty arguments) and then its arguments. Malformed calls
    are never an error: their text stays content.
    """

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._shaper = ContentShaper()

    @abstractmethod
    def feed(self, delta: str) -> list[Delta]: ...

    @abstractmethod
    def finish(self) -> list[Delta]: ...

    def _content(self, out: list[Delta], text: str) -> None:
        if sent := self._shaper.text(text):
            out.append(ContentDelta(sent))

    def _call(self, out: list[Delta], call: ToolCall) -> None:
        # NOTE: a call is sent whole, once its JSON is complete: only then is it known to be a call
        # (invalid JSON stays text), and its arguments are the exact text the whole-text parse gives,
        # where re-serialising a partial object could send fragments that are later contradicted.
        self._shaper.call()
        out.extend(call_deltas(len(self.calls), call))
        self.calls.append(call)

    def _finish_content(self, out: list[Delta]) -> list[Delta]:
        if held := self._shaper.finish():
            out.append(ContentDelta(held))
        return out


class ToolParser(ABC):
    """A calling convention, by name (`registry.TOOL_PARSERS`); stateless, shared by all requests."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """A whole output: its content without the calls, and the calls in order."""

    @abstractmethod
    def stream(self) -> ToolStreamParser:
        """A fresh parser for one streamed output."""
