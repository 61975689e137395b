"""OpenAI tool calling for the chat endpoint, as library code the request path calls (no torch).

    request.py     `tools` / `tool_choice` models, each field checked
    fields.py      the fields checked together; `ToolFields`, a request model's mixin
    messages.py    the tool parts of chat history (`tool_calls`, `tool_call_id`)
    parameters.py  a function's JSON Schema, checked and bounded
    render.py      history and tools as a chat template takes them (native, or the Hermes fallback)
    forced.py      "required" / named choice: the grammar's JSON Schema, and its output read back
    parser.py      the "auto" parser contract; hermes.py, llama3_json.py; registry.py by name
    calls.py       ToolCall, stream deltas, finish_reason
"""

from kvbaton.server.tools.calls import (
    TOOL_CALLS_FINISH_REASON,
    ContentDelta,
    Delta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    chat_finish_reason,
)
from kvbaton.server.tools.fields import ToolFields, check_tool_fields
from kvbaton.server.tools.forced import forced_stream_parser, parse_forced_output, tool_call_schema
from kvbaton.server.tools.messages import MessageToolCall, ToolMessageFields
from kvbaton.server.tools.parser import ToolParser, ToolStreamParser
from kvbaton.server.tools.registry import TOOL_PARSERS, tool_parser
from kvbaton.server.tools.render import RenderedChat, TemplateTools, inspect_chat_template, render_messages
from kvbaton.server.tools.request import (
    FunctionDefinition,
    NamedToolChoice,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    ToolChoiceParam,
    Tools,
    effective_tool_choice,
)

__all__ = [
    "TOOL_CALLS_FINISH_REASON", "TOOL_PARSERS", "ContentDelta", "Delta", "FunctionDefinition", "MessageToolCall",
    "NamedToolChoice", "ParsedOutput", "RenderedChat", "TemplateTools", "Tool", "ToolCall", "ToolCallDelta",
    "ToolChoice", "ToolChoiceMode", "ToolChoiceParam", "ToolFields", "ToolMessageFields", "ToolParser",
    "ToolStreamParser", "Tools", "chat_finish_reason", "check_tool_fields", "effective_tool_choice",
    "forced_stream_parser", "inspect_chat_template", "parse_forced_output", "render_messages",
    "tool_call_schema", "tool_parser",
]
