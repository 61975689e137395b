"""OpenAI chat history with tools, as a Hugging Face chat template takes it.

A template that renders `tools` itself (Qwen2.5, Llama 3.1, ...) gets them as the `tools=` argument
of `apply_chat_template`, and assistant calls with their arguments decoded, as HF templates expect.
A template that knows nothing of tools (SmolLM2) gets the Hermes convention spelled out: the tools and
how to call them appended to the system prompt, calls written back as `<tool_call>` blocks and
results as `<tool_response>` blocks in a user turn, so any template renders them as plain text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta
from pydantic import ValidationError

from kvbaton.server.tools.messages import MessageToolCall
from kvbaton.server.tools.request import Tool
from kvbaton.server.tools.scan import dumps_json, loads_json

FALLBACK_PARSER = "hermes"

# NOTE: the wording Hermes 2 Pro and Qwen2.5 were trained on: a small model follows it far more
# reliably than a description of our own.
HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools."""

    native: bool  # it renders the `tools` argument itself
    parser: str  # the convention its model was taught to call in (a `registry.TOOL_PARSERS` name)


@dataclass(frozen=True)
class RenderedChat:
    messages: list[dict[str, Any]]  # for apply_chat_template
    tools: list[dict[str, Any]] | None  # its `tools=` argument; None in the fallback (they are in the prompt)
    parser: str  # the parser for the model's reply


def inspect_chat_template(chat_template: str | None) -> TemplateTools:
    """Once per tokenizer (it parses the template), not per request."""
    if not chat_template or not _uses_tools(chat_template):
        return TemplateTools(native=False, parser=FALLBACK_PARSER)
    if "<tool_call>" in chat_template:
        return TemplateTools(native=True, parser="hermes")
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return TemplateTools(native=True, parser="llama3_json")
    return TemplateTools(native=True, parser=FALLBACK_PARSER)


def _uses_tools(chat_template: str) -> bool:
    """Whether the template reads a `tools` variable (jinja's own analysis, else a word search for
    templates using tags only HF's environment defines, such as `{% generation %}`)."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", chat_template) is not None
    return "tools" in meta.find_undeclared_variables(ast)


def render_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool] | None,
                    tokenizer_has_tools_support: bool, native_parser: str = FALLBACK_PARSER) -> RenderedChat:
    """`messages` (OpenAI dicts, text content already joined) for the template; ValueError naming the
    message if a `tool_calls` entry is malformed."""
    if tokenizer_has_tools_support:
        return RenderedChat([_native(m, i) for i, m in enumerate(messages)],
                            [tool.openai() for tool in tools] if tools else None, native_parser)
    return RenderedChat(_fallback(messages, tools or []), None, FALLBACK_PARSER)


def _text(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}].content: expected text (content parts joined), got {type(content).__name__}")
    return content or ""


def _content(message: Mapping[str, Any], i: int) -> str | list[dict[str, Any]]:
    """The text, or for a message with images its parts as the template takes them (`plain_messages`)."""
    content = message.get("content")
    return content if isinstance(content, list) else _text(message, i)


def _calls(message: Mapping[str, Any], i: int) -> list[MessageToolCall]:
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        try:
            calls.append(MessageToolCall.model_validate(call))
        except ValidationError as e:
            first = e.errors()[0]
            where = "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in first["loc"])
            raise ValueError(f"messages[{i}].tool_calls[{j}]{where}: {first['msg']}") from None
    return calls


def _arguments(call: MessageToolCall) -> Any:
    """Decoded, as templates expect (they `tojson` it); text that is not JSON is passed as it is."""
    try:
        return loads_json(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _native(message: Mapping[str, Any], i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": _content(message, i)}
    if calls := _calls(message, i):
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c)}} for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _fallback(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous_role = None
    for i, message in enumerate(messages):
        role, content = message["role"], _content(message, i)
        if isinstance(content, list):  # a message with images: its parts, the call blocks after them
            if role == "tool":
                raise ValueError(f"messages[{i}]: a tool's result takes no images")
            calls = _with_calls("", _calls(message, i))
            out.append({"role": role, "content": content + ([{"type": "text", "text": calls}] if calls else [])})
            previous_role = role
            continue
        text = content
        if role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            # consecutive results (of parallel calls) share one user turn, as Qwen2.5's template does
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": role, "content": _with_calls(text, _calls(message, i))})
        previous_role = role
    return _with_tools_prompt(out, tools)


def _with_calls(text: str, calls: list[MessageToolCall]) -> str:
    blocks = [f"<tool_call>\n{dumps_json({'name': c.function.name, 'arguments': _arguments(c)})}\n</tool_call>"
              for c in calls]
    return "\n".join([text, *blocks] if text else blocks) if blocks else text


def _with_tools_prompt(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    if not tools:
        return messages
    prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(dumps_json(tool.openai()) for tool in tools))
    if messages and messages[0]["role"] == "system":
        head = messages[0]["content"]
        return [{"role": "system", "content": f"{head}\n\n{prompt}" if head else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
