"""Hermes / Qwen calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number,
anywhere in the text.

A block whose body is not a JSON object with a string `name` and an object `arguments` stays in the
content, tags and all. A block left open at the end of the output (the model stopped before
`</tool_call>`) is a call if its body is complete JSON.
"""

from __future__ import annotations

from kvbaton.server.tools.calls import Delta, ParsedOutput, ToolCall
from kvbaton.server.tools.content import ContentShaper
from kvbaton.server.tools.parser import ToolParser, ToolStreamParser
from kvbaton.server.tools.scan import dumps_json, held_prefix_len, loads_json

START, END = "<tool_call>", "</tool_call>"


def parse_block(body: str) -> ToolCall | None:
    """The call in a block's body, or None if it is not one."""
    try:
        obj = loads_json(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    # some fine-tunes write "parameters" (the Llama spelling) inside Hermes tags
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall.new(obj["name"], dumps_json(arguments))


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        shaper, content, calls = ContentShaper(), [], []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            content.append(shaper.text(text[pos:start]))
            end = text.find(END, start + len(START))
            stop = len(text) if end == -1 else end + len(END)
            call = parse_block(text[start + len(START):len(text) if end == -1 else end])
            if call is None:
                content.append(shaper.text(text[start:stop]))
            else:
                shaper.call()
                calls.append(call)
            pos = stop
        content.append(shaper.text(text[pos:]))
        content.append(shaper.finish())
        return ParsedOutput("".join(content), calls)

    def stream(self) -> ToolStreamParser:
        return HermesStreamParser()


class HermesStreamParser(ToolStreamParser):
    """Text is sent as it comes, except a tail that may be the start of `<tool_call>`; a block is
    held until `</tool_call>` (or the end of the output) and then sent as a call or as text."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # outside a block: the held tail; inside: the block's body so far
        self._in_block = False
        self._searched = 0  # inside a block: where the search for END resumes (no rescanning)

    def feed(self, delta: str) -> list[Delta]:
        out: list[Delta] = []
        self._buf += delta
        while self._close_block(out) if self._in_block else self._open_block(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_block:
            self._resolve(out, self._buf, closed=False)
        else:
            self._content(out, self._buf)
        self._buf, self._in_block = "", False
        return self._finish_content(out)

    def _open_block(self, out: list[Delta]) -> bool:
        """Send the text before a START; True if a block opened."""
        start = self._buf.find(START)
        if start == -1:
            keep = len(self._buf) - held_prefix_len(self._buf, START)
            self._content(out, self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        self._content(out, self._buf[:start])
        self._buf, self._in_block, self._searched = self._buf[start + len(START):], True, 0
        return True

    def _close_block(self, out: list[Delta]) -> bool:
        """True if the open block ended (as a call or as text)."""
        end = self._buf.find(END, self._searched)
        if end == -1:
            self._searched = max(0, len(self._buf) - len(END) + 1)
            return False
        self._resolve(out, self._buf[:end], closed=True)
        self._buf, self._in_block = self._buf[end + len(END):], False
        return True

    def _resolve(self, out: list[Delta], body: str, closed: bool) -> None:
        call = parse_block(body)
        if call is None:
            self._content(out, START + body + (END if closed else ""))
        else:
            self._call(out, call)
