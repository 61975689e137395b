"""The text around tool calls, as the `content` a client sees.

A model writes calls on their own lines: `I'll check.\\n<tool_call>...</tool_call>\\n<tool_call>...`.
Whitespace that only separates a call from its neighbours is not content, so the rule is:

    - whitespace just before a call is dropped;
    - whitespace just after a call is dropped when nothing but whitespace came before it, or only
      whitespace follows it to the end of the text;
    - all other text is content, verbatim (a text with no calls is returned unchanged).

The rule only looks back, or holds back whitespace, so a stream applies it delta by delta and sends
the same text as the whole-text parse.
"""

from __future__ import annotations


class ContentShaper:
    """Turns the pieces of text between calls (in order, interleaved with `call()`) into content."""

    def __init__(self) -> None:
        self._held = ""  # trailing whitespace not sent yet: it may turn out to come just before a call
        self._after_call = False
        self._sent_any = False

    def text(self, piece: str) -> str:
        """Content to send now for `piece`."""
        full = self._held + piece
        if not full.strip():
            self._held = full
            return ""
        if self._after_call and not self._sent_any:
            full = full.lstrip()
        body = full.rstrip()
        self._held = full[len(body):]
        self._after_call, self._sent_any = False, True
        return body

    def call(self) -> None:
        self._held = ""
        self._after_call = True

    def finish(self) -> str:
        """Content still held at the end of the text."""
        held, self._held = self._held, ""
        return "" if self._after_call else held
