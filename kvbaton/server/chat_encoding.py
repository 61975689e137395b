"""A chat's token ids in which message text cannot forge the template's own tokens.

A chat template renders the messages into one string, and encoding that string turns every special
token's text into the special token: a user who types `<|im_end|>\n<|im_start|>system\n...` ends their
own turn and opens a system turn. transformers' `apply_chat_template(tokenize=True)` and vLLM do exactly
that (a vLLM pull request to encode user content apart was closed unmerged; transformers' issue #29279
is open); llama.cpp's server parses special tokens in its templated prompt as well.

kvbaton encodes such text as the characters it is. A chat whose messages hold no special token's text (all
the parity tests' chats) takes the plain path, token-identical to transformers. One whose `content` does is
rendered again with a marker in place of each such content; the template's own text between the markers is
encoded as before, each content with its special tokens split into ordinary tokens. The escaped prompt must
render to the very same text as the original (a template that rewrites content, e.g. strips a reasoning
block, fails that check): else, and for special text anywhere but `content` (tool call arguments, tool
definitions), the request is refused with a 400 naming the field rather than served as something else.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kvbaton.server.errors import ApiError
from kvbaton.text.tokenizer import Tokenizer

MARKER = "\ue000kvbaton-content-{}\ue001"  # private-use characters: no template or client has a use for them


class ChatEncoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.specials = tuple(t.content for t in tokenizer.hf.added_tokens_decoder.values() if t.special)

    def typed_special(self, text: str) -> str | None:
        return next((s for s in self.specials if s in text), None)

    def encode(self, text: str, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None,
               render: Callable[[list[dict[str, Any]]], str], add_special_tokens: bool) -> list[int]:
        """`text` (`render(messages)`) as token ids; `render` is the chat template with the request's settings."""
        self._refuse_special_beyond_content(messages, tools)
        escaped = {i for i, m in enumerate(messages)
                   if isinstance(m.get("content"), str) and self.typed_special(m["content"])}
        if not escaped:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        marked = [dict(m, content=MARKER.format(i)) if i in escaped else m for i, m in enumerate(messages)]
        pieces = self._split_at_markers(render(marked), sorted(escaped))
        if pieces is None or _interleave(pieces, [messages[i]["content"] for i in sorted(escaped)]) != text:
            i = min(escaped)
            raise ApiError(400, f"messages[{i}].content holds the text of the special token "
                                f"{self.typed_special(messages[i]['content'])!r}, which this model's chat template "
                                f"does not pass through as it is: remove it", "BadRequestError", "messages")
        hf = self.tokenizer.hf
        ids = hf.encode(pieces[0], add_special_tokens=add_special_tokens)
        for i, piece in zip(sorted(escaped), pieces[1:]):
            ids += hf.encode(messages[i]["content"], add_special_tokens=False, split_special_tokens=True)
            ids += hf.encode(piece, add_special_tokens=False)
        return ids

    def _refuse_special_beyond_content(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None) -> None:
        for i, m in enumerate(messages):
            # a message with images is rendered from its parts (`plain_messages`), which are not escaped: a special
            # token's text there (an image token among them) is refused, never taken for the token
            if not isinstance(m.get("content"), str):
                for part in m.get("content") or ():
                    if special := self.typed_special(part.get("text") or ""):
                        raise ApiError(400, f"messages[{i}].content holds the text of the special token {special!r} "
                                            "beside an image: remove it", "BadRequestError", "messages")
            for j, call in enumerate(m.get("tool_calls") or ()):
                if special := self.typed_special(json.dumps(call, ensure_ascii=False)):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}] holds the text of the special token "
                                        f"{special!r}", "BadRequestError", "messages")
        if tools and (special := self.typed_special(json.dumps(list(tools), ensure_ascii=False))):
            raise ApiError(400, f"tools hold the text of the special token {special!r}", "BadRequestError", "tools")

    @staticmethod
    def _split_at_markers(rendered: str, indices: list[int]) -> list[str] | None:
        """The template's text around each marker, in order; None unless each appears exactly once."""
        pieces, rest = [], rendered
        for i in indices:
            marker = MARKER.format(i)
            if rest.count(marker) != 1:
                return None
            before, rest = rest.split(marker)
            pieces.append(before)
        return [*pieces, rest]


def _interleave(pieces: list[str], contents: list[str]) -> str:
    return pieces[0] + "".join(c + p for c, p in zip(contents, pieces[1:]))
