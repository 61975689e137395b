"""A chat request's `tools` and `tool_choice` (OpenAI's shapes; pydantic, validated by FastAPI).

Each field is type- and bound-checked where it is, so a 400 names it (`tools.2.function.name`);
what needs the fields together is `fields.check_tool_fields`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, PlainValidator, Strict, ValidationError, field_validator

from kvbaton.server.tools.parameters import EMPTY_PARAMETERS, check_parameters, count_objects

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_OBJECTS = 4096  # JSON objects in all the tools (their schemas' meta-schema check: ~0.3 ms each)
MAX_DESCRIPTION_CHARS = 16_384

FunctionName = Annotated[str, Strict(), Field(pattern=NAME_PATTERN)]


def unicode_text(value: str, what: str) -> str:
    """`value`, refused if it holds a lone surrogate (a JSON `\\ud800`), which no tokenizer encodes.

    NOTE: `kvbaton.server.protocol.utf8_text` does the same; that module will import this package, so
    this one cannot import it back."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate such as \\ud800)") from None
    return value


class FunctionDefinition(BaseModel):
    name: FunctionName
    description: Annotated[str, Strict(), Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema for the arguments object
    strict: Annotated[bool, Strict()] | None = None

    @field_validator("description")
    @classmethod
    def _description_text(cls, description: str | None) -> str | None:
        return None if description is None else unicode_text(description, "description")

    @field_validator("parameters")
    @classmethod
    def _parameters_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if parameters is None else check_parameters(parameters)

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return EMPTY_PARAMETERS if self.parameters is None else self.parameters


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def openai(self) -> dict[str, Any]:
        """As OpenAI shows it (and chat templates take it): `{"type": "function", "function": {...}}`."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class ToolChoiceMode(str, enum.Enum):
    NONE = "none"  # answer in text
    AUTO = "auto"  # text or calls, as the model decides
    REQUIRED = "required"  # one or more calls, to any of the tools


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    """Exactly one call, to this function."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = ToolChoiceMode | NamedToolChoice
_MODES = frozenset(mode.value for mode in ToolChoiceMode)


def parse_tool_choice(value: Any) -> ToolChoice:
    """A mode name or a named function. (Plain rather than a pydantic union: a union's error would
    name each member it tried, not the field.)"""
    if isinstance(value, (ToolChoiceMode, NamedToolChoice)):
        return value
    if isinstance(value, str) and value in _MODES:
        return ToolChoiceMode(value)
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as e:
            first = e.errors()[0]
            raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    shown = repr(value[:40]) if isinstance(value, str) else type(value).__name__
    raise ValueError(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {shown}")


def _at_most_max_tools(tools: Any) -> Any:
    # before the items are validated: the work their schemas cost grows with the tools and their objects
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    if (objects := count_objects(tools, MAX_TOOLS_OBJECTS)) > MAX_TOOLS_OBJECTS:
        raise ValueError(f"more than {MAX_TOOLS_OBJECTS} JSON objects in the tools together ({objects} counted)")
    return tools


Tools = Annotated[list[Tool], BeforeValidator(_at_most_max_tools)]
ToolChoiceParam = Annotated[ToolChoice, PlainValidator(
    parse_tool_choice, json_schema_input_type=Literal["none", "auto", "required"] | NamedToolChoice)]


def effective_tool_choice(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: "auto" when there are tools, "none" when there are none."""
    if tool_choice is not None:
        return tool_choice
    return ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE
