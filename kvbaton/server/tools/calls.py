"""What a parsed tool call is, and how it is reported: whole (a response's `message.tool_calls`) or
as stream deltas (a chunk's `delta`), and the `finish_reason` a response with calls ends with."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvbaton.sched.outputs import FinishReason

TOOL_CALLS_FINISH_REASON = "tool_calls"


def new_call_id() -> str:
    """`call_` and 24 random hex digits, the shape of OpenAI's ids (clients echo it as `tool_call_id`)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text (OpenAI sends arguments as a string, not an object)

    @classmethod
    def new(cls, name: str, arguments: str) -> ToolCall:
        return cls(new_call_id(), name, arguments)

    def openai(self) -> dict[str, Any]:
        """One entry of a response message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ParsedOutput(NamedTuple):
    content: str  # the text outside the calls ("" when there is none: send `content: null` then)
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True, kw_only=True)
class ToolCallDelta:
    """Part of call `index`: its first delta carries `id` and `name` (and empty arguments), later ones
    only argument text; a client concatenates the arguments of one index."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    @classmethod
    def header(cls, index: int, call: ToolCall) -> ToolCallDelta:
        return cls(index=index, id=call.id, name=call.name, arguments="")

    def openai(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        if self.id is None:
            entry["function"] = {"arguments": self.arguments}
        else:
            entry |= {"id": self.id, "type": "function",
                      "function": {"name": self.name, "arguments": self.arguments}}
        return {"tool_calls": [entry]}


Delta = ContentDelta | ToolCallDelta


def call_deltas(index: int, call: ToolCall) -> list[Delta]:
    """A whole call as a stream sends it: the header, then its arguments in one fragment."""
    return [ToolCallDelta.header(index, call), ToolCallDelta(index=index, arguments=call.arguments)]


def chat_finish_reason(engine_reason: str | None, produced_calls: bool) -> str | None:
    """OpenAI's rule: a response that ends naturally having produced calls finishes with "tool_calls".

    NOTE: "length" (and "abort") stay as they are even with calls: the output was cut, and the client
    must know the last call (or text after it) may be missing."""
    if produced_calls and engine_reason == FinishReason.STOP.value:
        return TOOL_CALLS_FINISH_REASON
    return engine_reason
