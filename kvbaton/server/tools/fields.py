"""The tool fields of a chat request together: what no one field's check can see.

`check_tool_fields` raises a ValueError whose message names the field ("tools[3].function.name:
..."), so run from a model validator (as `ToolFields` does) it is a 400 with that message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, Strict, model_validator
from typing_extensions import Self

from kvbaton.sched.grammar_spec import MAX_GRAMMAR_CHARS
from kvbaton.server.tools.forced import tool_call_schema
from kvbaton.server.tools.parameters import schema_bytes
from kvbaton.server.tools.request import (
    MAX_TOOLS,
    NamedToolChoice,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    ToolChoiceParam,
    Tools,
    effective_tool_choice,
)

# NOTE: what the tools add to the prompt, for the whole request. (The meta-schema check's work is bounded
# by their JSON objects, `request.MAX_TOOLS_OBJECTS`, before any tool is parsed.)
MAX_TOOLS_PARAMETERS_BYTES = 256 * 1024


def check_tool_fields(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None,
                      parallel_tool_calls: bool = True) -> None:
    """ValueError, naming the field, unless the fields agree: unique function names, the schemas
    within bounds together (and, for "required", as the one grammar they become), a named choice
    among the tools, and no choice but "none" without tools."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    _check_unique_names(tools)
    total = sum(schema_bytes(tool.function.parameters_schema) for tool in tools)
    if total > MAX_TOOLS_PARAMETERS_BYTES:
        raise ValueError(f"tools: the parameters schemas take {total} bytes together, more than "
                         f"{MAX_TOOLS_PARAMETERS_BYTES}")
    if tool_choice is None or tool_choice is ToolChoiceMode.NONE:
        return
    if not tools:
        shown = repr(tool_choice.value) if isinstance(tool_choice, ToolChoiceMode) else "a named function"
        raise ValueError(f"tool_choice: {shown} needs tools, and the request has none")
    if isinstance(tool_choice, NamedToolChoice) and all(t.function.name != tool_choice.function.name for t in tools):
        raise ValueError(f"tool_choice.function.name: no tool named {tool_choice.function.name!r} in tools")
    if tool_choice is ToolChoiceMode.REQUIRED:
        # measured as the structured-output spec serialises it (ASCII JSON: "é" takes 6 characters)
        chars = len(json.dumps(tool_call_schema(tools, tool_choice, parallel_tool_calls), separators=(",", ":")))
        if chars > MAX_GRAMMAR_CHARS:
            raise ValueError(f"tools: with tool_choice 'required' they become one schema of {chars} characters, "
                             f"more than the {MAX_GRAMMAR_CHARS} a grammar may have")


def _check_unique_names(tools: Sequence[Tool]) -> None:
    index_of: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if (first := index_of.setdefault(tool.function.name, i)) != i:
            raise ValueError(f"tools[{i}].function.name: {tool.function.name!r} is already the name of "
                             f"tools[{first}]; function names must be unique")


class ToolFields(BaseModel):
    """The tool fields of a chat request; a request model inherits them (and the check that they agree)."""

    tools: Tools | None = None
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: Annotated[bool, Strict()] = True

    @model_validator(mode="after")
    def _tool_fields_agree(self) -> Self:
        check_tool_fields(self.tools, self.tool_choice, self.parallel_tool_calls)
        return self

    def resolved_tool_choice(self) -> ToolChoice:
        return effective_tool_choice(self.tools, self.tool_choice)
