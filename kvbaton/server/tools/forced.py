"""`tool_choice: "required"` or a named function: the output is constrained by a grammar (a JSON
Schema, for llguidance) to be the calls, and read back as calls without looking for any convention.

    required:  [{"name": "get_weather", "parameters": {...}}, ...]   one or more, to any of the tools
    named:     {...}                                                 the arguments of that one function
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Sequence
from typing import Any

from kvbaton.server.tools.calls import Delta, ToolCall, ToolCallDelta
from kvbaton.server.tools.parser import ToolStreamParser
from kvbaton.server.tools.request import NamedToolChoice, Tool, ToolChoice, ToolChoiceMode
from kvbaton.server.tools.scan import ObjectScanner, dumps_json, loads_json


def tool_call_schema(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None,
                     parallel_tool_calls: bool = True) -> dict[str, Any] | None:
    """The JSON Schema the output must match, or None where the model answers freely (auto, none)."""
    if isinstance(tool_choice, NamedToolChoice):
        return copy.deepcopy(_named(tools, tool_choice).function.parameters_schema)
    if tool_choice is not ToolChoiceMode.REQUIRED:
        return None
    if not tools:
        raise ValueError("tool_choice 'required' needs tools")
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _named(tools: Sequence[Tool] | None, choice: NamedToolChoice) -> Tool:
    for tool in tools or []:
        if tool.function.name == choice.function.name:
            return tool
    raise ValueError(f"tool_choice.function.name: no tool named {choice.function.name!r} in tools")


def _call_schema(tool: Tool) -> dict[str, Any]:
    name, parameters = tool.function.name, copy.deepcopy(tool.function.parameters_schema)
    # NOTE: embedded in the array's schema, the tool's `{"$ref": "#/$defs/..."}` would resolve against
    # the array's root. An `$id` makes the tool's schema a resource of its own that its references
    # resolve within (Draft 2020-12), so none is rewritten and two tools' `$defs` cannot clash (vLLM
    # instead hoists every `$defs` to the root and refuses clashing names).
    if "$id" not in parameters:
        parameters = {"$id": f"urn:kvbaton:tool:{name}", **parameters}
    return {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def forced_stream_parser(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None) -> ToolStreamParser:
    """A stream parser for a grammar-constrained output (see the `ToolStreamParser` contract; it never
    sends content)."""
    if isinstance(tool_choice, NamedToolChoice):
        return NamedCallStream(_named(tools, tool_choice).function.name)
    if tool_choice is ToolChoiceMode.REQUIRED:
        return RequiredCallsStream({tool.function.name for tool in tools or []})
    raise ValueError(f"only 'required' or a named function constrain the output, not {tool_choice!r}")


def parse_forced_output(text: str, tools: Sequence[Tool] | None, tool_choice: ToolChoice | None) -> list[ToolCall]:
    """The calls in a whole grammar-constrained output.

    Cut short (finish_reason "length"), a required output gives the calls completed before the cut,
    and a named one its call with the arguments as far as they got, as OpenAI reports them then."""
    parser = forced_stream_parser(tools, tool_choice)
    parser.feed(text)
    parser.finish()
    return parser.calls


class NamedCallStream(ToolStreamParser):
    """The whole output is the arguments: sent as generated (the grammar makes every prefix the start
    of a valid object), after the header once the first non-whitespace text arrives."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._id: str | None = None
        self._arguments: list[str] = []

    def feed(self, delta: str) -> list[Delta]:
        self._arguments.append(delta)
        if self._id is not None:
            return [ToolCallDelta(index=0, arguments=delta)] if delta else []
        so_far = "".join(self._arguments)
        if not so_far.strip():
            return []
        header = ToolCall.new(self._name, "")
        self._id = header.id
        return [ToolCallDelta.header(0, header), ToolCallDelta(index=0, arguments=so_far)]

    def finish(self) -> list[Delta]:
        if self._id is not None and not self.calls:
            self.calls.append(ToolCall(self._id, self._name, "".join(self._arguments)))
        return []


class _Expect(enum.Enum):
    OPEN = enum.auto()  # the array's `[`
    ITEM = enum.auto()  # an item's `{`
    IN_ITEM = enum.auto()
    NEXT = enum.auto()  # `,` or the closing `]`
    DONE = enum.auto()


class RequiredCallsStream(ToolStreamParser):
    """Sends each array item as a call once its object closes; stops at the first thing that is not
    one (the closing `]`, or anything no grammar would have allowed)."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self._names = names
        self._expect = _Expect.OPEN
        self._item = ""
        self._scanner = ObjectScanner()

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        while delta:
            delta = self._step(out, delta)
        return out

    def finish(self) -> list[Delta]:
        self._expect = _Expect.DONE
        return []

    def _step(self, out: list[Delta], text: str) -> str:
        if self._expect is _Expect.IN_ITEM:
            return self._item_text(out, text)
        rest = text.lstrip()
        if self._expect is _Expect.DONE or not rest:
            return ""
        opens = {_Expect.OPEN: "[", _Expect.ITEM: "{", _Expect.NEXT: ","}[self._expect]
        if rest[0] != opens:
            self._expect = _Expect.DONE
            return ""
        if self._expect is _Expect.ITEM:
            self._expect = _Expect.IN_ITEM
            return rest  # the scanner starts at the `{`
        self._expect = _Expect.ITEM
        return rest[1:]

    def _item_text(self, out: list[Delta], text: str) -> str:
        end = self._scanner.feed(text)
        if end is None:
            self._item += text
            return ""
        body, self._item, self._scanner = self._item + text[:end], "", ObjectScanner()
        call = self._item_call(body)
        if call is None:
            self._expect = _Expect.DONE
            return ""
        self._call(out, call)
        self._expect = _Expect.NEXT
        return text[end:]

    def _item_call(self, body: str) -> ToolCall | None:
        try:
            item = loads_json(body)
        except ValueError:
            return None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if item["name"] not in self._names or not isinstance(item.get("parameters"), dict):
            return None
        return ToolCall.new(item["name"], dumps_json(item["parameters"]))
