"""The tool parts of chat history: an assistant message's `tool_calls` and a tool message's
`tool_call_id` (OpenAI's shapes; a `ChatMessage` inherits `ToolMessageFields`).

Lenient on what the server itself produced: a name is any short string (a parser reports whatever
name the model wrote) and arguments any string (an output cut by max_tokens leaves them unfinished),
so a client that replays a response never gets a 400 for it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, Strict, field_validator

from kvbaton.server.tools.request import MAX_TOOLS, unicode_text

MAX_CALL_ID_CHARS = 256
MAX_CALLED_NAME_CHARS = 256

CallId = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_CALL_ID_CHARS)]


class CalledFunction(BaseModel):
    name: Annotated[str, Strict(), Field(min_length=1, max_length=MAX_CALLED_NAME_CHARS)]
    arguments: Annotated[str, Strict()]  # JSON text, as the server sent it

    @field_validator("name", "arguments")
    @classmethod
    def _text(cls, value: str) -> str:
        return unicode_text(value, "the text")


class MessageToolCall(BaseModel):
    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolMessageFields(BaseModel):
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: CallId | None = None  # tool: the call this message is the result of
