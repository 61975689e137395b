"""Llama 3.x JSON calls: the output *is* the calls, `{"name": ..., "parameters": {...}}` objects
separated by `;` (or whitespace), optionally after `<|python_tag|>`.

An output that does not start with an object (after whitespace and the tag) is all content, as is
one whose first object is not a call; after one or more calls, the text from the first thing that is
not a call on is content (the separators before it are not).
"""

from __future__ import annotations

import enum

from kvbaton.server.tools.calls import Delta, ParsedOutput, ToolCall
from kvbaton.server.tools.content import ContentShaper
from kvbaton.server.tools.parser import ToolParser, ToolStreamParser
from kvbaton.server.tools.scan import ObjectScanner, dumps_json, loads_json

TAG = "<|python_tag|>"
SEPARATORS = " \t\r\n;"


def parse_object(text: str) -> ToolCall | None:
    try:
        obj = loads_json(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall.new(obj["name"], dumps_json(arguments))


class _Lead(enum.Enum):
    UNDECIDED = enum.auto()  # only whitespace or part of the tag so far
    TEXT = enum.auto()
    OBJECT = enum.auto()


def read_lead(text: str) -> tuple[_Lead, int]:
    """What the start of an output is; for OBJECT, the offset of its `{`."""
    rest = text.lstrip()
    if rest.startswith(TAG):
        rest = rest[len(TAG):].lstrip()
    elif TAG.startswith(rest):
        return _Lead.UNDECIDED, 0
    if not rest:
        return _Lead.UNDECIDED, 0
    return (_Lead.OBJECT, len(text) - len(rest)) if rest[0] == "{" else (_Lead.TEXT, 0)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        lead, pos = read_lead(text)
        calls: list[ToolCall] = []
        while lead is _Lead.OBJECT:
            end = ObjectScanner().feed(text[pos:])
            call = None if end is None else parse_object(text[pos:pos + end])
            if call is None or end is None:
                break
            calls.append(call)
            pos = len(text) - len(text[pos + end:].lstrip(SEPARATORS))
            if not text.startswith("{", pos):
                break
        if not calls:
            return ParsedOutput(text, [])
        shaper = ContentShaper()
        shaper.call()
        return ParsedOutput(shaper.text(text[pos:]) + shaper.finish(), calls)

    def stream(self) -> ToolStreamParser:
        return Llama3JsonStreamParser()


class _State(enum.Enum):
    LEAD = enum.auto()  # deciding whether the output starts with a call
    OBJECT = enum.auto()  # inside an object
    SEPARATOR = enum.auto()  # after a call
    TEXT = enum.auto()  # content to the end


class Llama3JsonStreamParser(ToolStreamParser):
    """Holds the start of the output until it is known to be a call or not, then each object until it
    closes; sends a call per object, or everything from a failed object on as content."""

    def __init__(self) -> None:
        super().__init__()
        self._state = _State.LEAD
        self._prefix = ""  # the text before the first object: sent verbatim if that object fails
        self._object = ""
        self._scanner = ObjectScanner()

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        while delta:
            delta = self._step(out, delta)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._state in (_State.LEAD, _State.OBJECT):
            self._content(out, self._prefix + self._object)
        self._state, self._prefix, self._object = _State.TEXT, "", ""
        return self._finish_content(out)

    def _step(self, out: list[Delta], text: str) -> str:
        """Consume some of `text`; return the rest, for the state this leaves."""
        if self._state is _State.LEAD:
            return self._lead(out, text)
        if self._state is _State.OBJECT:
            return self._object_text(out, text)
        if self._state is _State.SEPARATOR:
            rest = text.lstrip(SEPARATORS)
            if rest:
                self._state = _State.OBJECT if rest[0] == "{" else _State.TEXT
            return rest
        self._content(out, text)
        return ""

    def _lead(self, out: list[Delta], text: str) -> str:
        self._prefix += text
        lead, pos = read_lead(self._prefix)
        if lead is _Lead.UNDECIDED:
            return ""
        if lead is _Lead.TEXT:
            self._state = _State.TEXT
            self._content(out, self._prefix)
            self._prefix = ""
            return ""
        self._state = _State.OBJECT
        rest, self._prefix = self._prefix[pos:], self._prefix[:pos]
        return rest

    def _object_text(self, out: list[Delta], text: str) -> str:
        end = self._scanner.feed(text)
        if end is None:
            self._object += text
            return ""
        body, self._object, self._scanner = self._object + text[:end], "", ObjectScanner()
        call = parse_object(body)
        if call is None:
            self._state = _State.TEXT
            self._content(out, self._prefix + body)
        else:
            self._state = _State.SEPARATOR
            self._call(out, call)
        self._prefix = ""
        return text[end:]
