"""One chat request's tool calling, from its prompt to each choice's answer: how the history and the
tools are rendered for the model's chat template, what grammar (if any) the output must match, and
how each choice's text is read back into `tool_calls`, whole or as stream deltas.

`required` and a named function are enforced: their JSON schema (`tools.tool_call_schema`) becomes
the request's grammar, so the output is calls and nothing else. `auto` lets the model choose, and a
parser of its calling convention (`tools.TOOL_PARSERS`, picked from its chat template) finds the
calls in its text. `none` renders no tools: the model answers in text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbaton.sched.grammar_spec import StructuredOutput
from kvbaton.server.tools import (
    NamedToolChoice,
    RenderedChat,
    TemplateTools,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolStreamParser,
    chat_finish_reason,
    forced_stream_parser,
    parse_forced_output,
    render_messages,
    tool_call_schema,
    tool_parser,
)


@dataclass(frozen=True)
class ToolCalling:
    tools: Sequence[Tool]
    choice: ToolChoice
    parser: str  # the convention of `auto` outputs
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice is ToolChoiceMode.REQUIRED or isinstance(self.choice, NamedToolChoice)

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of a forced choice; None for `auto`."""
        schema = tool_call_schema(self.tools, self.choice, self.parallel) if self.forced else None
        return None if schema is None else StructuredOutput.json_schema(schema)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's assistant message and its finish_reason ("tool_calls" once it called)."""
        if self.forced:
            content, calls = None, parse_forced_output(text, self.tools, self.choice)
        else:
            parsed = tool_parser(self.parser).parse(text)
            content, calls = parsed.content or None, parsed.calls
        calls = self._allowed(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message, chat_finish_reason(finish_reason, bool(calls))

    def stream(self) -> ToolStreamParser:
        """A parser for one streamed choice (feed it the text deltas; `finish()` once it ends)."""
        return forced_stream_parser(self.tools, self.choice) if self.forced else tool_parser(self.parser).stream()

    def _allowed(self, calls: list[ToolCall]) -> list[ToolCall]:
        # NOTE: with parallel_tool_calls false the grammar allows one call, but an `auto` model may write more
        return calls if self.parallel else calls[:1]


def plan_tool_calling(messages: list[dict[str, Any]], tools: Sequence[Tool] | None, choice: ToolChoice,
                      parallel: bool, template: TemplateTools) -> tuple[ToolCalling | None, RenderedChat]:
    """How the request's messages are rendered and its output read: (None, the history as it is) when
    the request calls no tools (no tools, or `none`, where the model is not shown them)."""
    if not tools or choice is ToolChoiceMode.NONE:
        return None, render_messages(messages, None, template.native, template.parser)
    rendered = render_messages(messages, tools, template.native, template.parser)
    return ToolCalling(tools, choice, rendered.parser, parallel), rendered
