"""Reading JSON out of generated text as it grows: where a tag may be starting, where an object ends.

Both parsers and the forced-choice parser decide from these alone, so a text split into any deltas is
cut at the same places as the whole text.
"""

from __future__ import annotations

import json
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


MAX_JSON_DEPTH = 64  # nested arrays and objects: deeper text would only reach a recursion limit further on


def loads_json(text: str) -> Any:
    """`json.loads`, refusing NaN and Infinity (Python accepts them, JSON and a client's parser do not) and
    nesting beyond `MAX_JSON_DEPTH` (Python's parser raises RecursionError past ~1,000 levels, and a
    template's `tojson` or a schema walk would, further on, well before that): a ValueError either way."""
    too_deep = f"nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(too_deep) from None
    if nesting_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ValueError(too_deep)
    return value


def nesting_depth(value: Any, limit: int) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0), counted up to one past `limit`, without
    recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= limit:
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def dumps_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def held_prefix_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (to hold back, not send)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ObjectScanner:
    """Finds the `}` that closes a JSON object, fed the text from its `{` on in pieces.

    Brace counting that skips strings (and escapes in them): for valid JSON it ends exactly where a
    JSON parser would; for invalid text it ends somewhere and the parse of that extent fails.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """The offset in `text` just past the closing brace, or None if the object is still open."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "{":
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return None
