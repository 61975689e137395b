"""kvbaton.server.tools: the request fields and their 400s, the forced-choice JSON Schema (checked
with jsonschema, and with llguidance over the default model's tokenizer where it is installed), the
auto parsers whole and streamed in any chunking, and chat history rendered through the default
model's real chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from kvbaton.sched.grammar_spec import MAX_GRAMMAR_CHARS
from kvbaton.server.tool_schemas import first_invalid
from kvbaton.server.tools import (
    ContentDelta,
    Delta,
    NamedToolChoice,
    Tool,
    ToolCallDelta,
    ToolChoiceMode,
    ToolFields,
    ToolStreamParser,
    chat_finish_reason,
    effective_tool_choice,
    forced_stream_parser,
    inspect_chat_template,
    parse_forced_output,
    render_messages,
    tool_call_schema,
    tool_parser,
)
from kvbaton.server.tools.fields import MAX_TOOLS_PARAMETERS_BYTES
from kvbaton.server.tools.parameters import (
    MAX_PARAMETERS_BYTES,
    MAX_PARAMETERS_DEPTH,
    MAX_PARAMETERS_SUBSCHEMAS,
    count_objects,
)
from kvbaton.server.tools.request import MAX_TOOLS, MAX_TOOLS_OBJECTS
from kvbaton.server.tools.scan import MAX_JSON_DEPTH, loads_json
from kvbaton.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["city"], "additionalProperties": False,
                   "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
# the same `$defs` name as WEATHER's, meaning something else: each tool's references must stay its own
TIMER = {"type": "function", "function": {
    "name": "set_timer",
    "parameters": {"type": "object", "properties": {"seconds": {"type": "integer", "minimum": 1},
                                                    "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["seconds"], "$defs": {"unit": {"const": "s"}}}}}
NO_ARGS = {"type": "function", "function": {"name": "get_time"}}


def fields(**body: Any) -> ToolFields:
    return ToolFields.model_validate(body)


def error_of(**body: Any) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as info:
        fields(**body)
    first = info.value.errors()[0]
    return first["loc"], first["msg"].removeprefix("Value error, ")


def tools(*specs: dict) -> list[Tool]:
    return [Tool.model_validate(spec) for spec in specs]


def test_the_package_imports_without_torch() -> None:
    """The HTTP process runs without torch (as tests/architecture checks for the server's modules)."""
    code = ("import sys\nsys.modules['torch'] = None\nimport kvbaton.server.tools\n"
            "assert 'torch' not in {n.split('.')[0] for n, m in sys.modules.items() if m is not None}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# --- request fields ---------------------------------------------------------------------------

def test_valid_tools_and_choices_parse() -> None:
    req = fields(tools=[WEATHER, TIMER, NO_ARGS], tool_choice={"type": "function", "function": {"name": "set_timer"}})
    assert [t.function.name for t in req.tools or []] == ["get_weather", "set_timer", "get_time"]
    assert isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name == "set_timer"
    assert fields(tools=[WEATHER], tool_choice="required").tool_choice is ToolChoiceMode.REQUIRED
    assert fields(tools=[WEATHER]).resolved_tool_choice() is ToolChoiceMode.AUTO
    assert fields().resolved_tool_choice() is ToolChoiceMode.NONE
    assert effective_tool_choice(None, ToolChoiceMode.NONE) is ToolChoiceMode.NONE


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "naïve", "a.b", 7])
def test_bad_function_names_are_refused_naming_the_field(name: Any) -> None:
    loc, _ = error_of(tools=[WEATHER, {"type": "function", "function": {"name": name}}])
    assert loc == ("tools", 1, "function", "name")


def test_duplicate_names_are_refused_naming_the_second() -> None:
    _, msg = error_of(tools=[WEATHER, TIMER, WEATHER])
    assert msg.startswith("tools[2].function.name: 'get_weather' is already the name of tools[0]")


@pytest.mark.parametrize(("parameters", "says"), [
    ({"type": "strin"}, "not a valid JSON Schema (Draft 2020-12): $.type"),
    ({"type": "object", "properties": {"a": {"minimum": "1"}}}, "$.properties.a.minimum"),
    ({"type": "string"}, "must describe an object"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "only references within"),
])
def test_invalid_parameters_schemas_are_found_by_the_meta_schema_check(parameters: dict, says: str) -> None:
    """Parsed (the bounds are met), then refused by the check the server runs in a thread, naming the tool."""
    req = fields(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": parameters}}])
    index, why = first_invalid(req.tools or []) or (None, "")
    assert index == 1 and says in why, why
    assert first_invalid(req.tools[:1] if req.tools else []) is None  # WEATHER alone is valid, and now remembered


def test_parameters_beyond_their_bounds_are_refused_while_parsed() -> None:
    """Before any meta-schema check: a 29 KiB schema of 9,800 empty sub-schemas cost 2.4 s of it on the loop."""
    for parameters, says in [
        ({"type": "object", "description": "x" * MAX_PARAMETERS_BYTES}, "bytes as JSON, more than"),
        ({"type": "object", "properties": {"a": {"anyOf": [{}] * MAX_PARAMETERS_SUBSCHEMAS}}},
         f"more than {MAX_PARAMETERS_SUBSCHEMAS} sub-schemas"),
    ]:
        loc, msg = error_of(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])
        assert loc == ("tools", 0, "function", "parameters")
        assert says in msg
    within_each = {"type": "object", "properties": {"a": {"anyOf": [{}] * (MAX_PARAMETERS_SUBSCHEMAS - 3)}}}
    assert count_objects(within_each, 10**6) <= MAX_PARAMETERS_SUBSCHEMAS
    many = [{"function": {"name": f"f{i}", "parameters": within_each}} for i in range(5)]
    for hostile in (many, [{"function": {"name": "f", "parameters": {"anyOf": [{}] * 9800}}}]):
        loc, msg = error_of(tools=hostile)
        assert loc == ("tools",) and msg.startswith(f"more than {MAX_TOOLS_OBJECTS} JSON objects in the tools")


def test_deep_and_non_json_schemas_are_refused() -> None:
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(MAX_PARAMETERS_DEPTH):
        node["not"] = {}
        node = node["not"]
    _, msg = error_of(tools=[{"function": {"name": "f", "parameters": deep}}])
    assert f"nested more than {MAX_PARAMETERS_DEPTH} levels" in msg
    body = '{"tools": [{"function": {"name": "f", "parameters": {"type": "object", "default": NaN}}}]}'
    with pytest.raises(ValidationError, match="NaN or Infinity"):
        ToolFields.model_validate_json(body)


def test_too_many_tools() -> None:
    many = [{"function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    loc, msg = error_of(tools=many)
    assert loc == ("tools",) and msg == f"at most {MAX_TOOLS} tools, got {MAX_TOOLS + 1}"
    assert len(fields(tools=many[:MAX_TOOLS]).tools or []) == MAX_TOOLS


def test_schemas_are_bounded_together() -> None:
    def tool(i: int, text: str) -> dict:
        return {"function": {"name": f"f{i}", "parameters": {"type": "object", "description": text}}}

    # within each tool's bound, past the total
    _, msg = error_of(tools=[tool(i, "x" * 30_000) for i in range(9)])
    assert msg.startswith("tools: the parameters schemas take") and f"more than {MAX_TOOLS_PARAMETERS_BYTES}" in msg
    # within the total, but as the one "required" grammar past its limit ("é" is 2 bytes, 6 characters escaped)
    wide = [tool(i, "é" * 10_000) for i in range(5)]
    assert len(fields(tools=wide, tool_choice="auto").tools or []) == 5
    _, msg = error_of(tools=wide, tool_choice="required")
    assert msg.startswith("tools: with tool_choice 'required'") and f"more than the {MAX_GRAMMAR_CHARS}" in msg


def test_tool_choice_must_agree_with_tools() -> None:
    _, msg = error_of(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "set_timer"}})
    assert msg == "tool_choice.function.name: no tool named 'set_timer' in tools"
    for choice in ("required", "auto", {"type": "function", "function": {"name": "get_weather"}}):
        _, msg = error_of(tool_choice=choice)
        assert msg.startswith("tool_choice: ") and "needs tools" in msg
    assert fields(tool_choice="none").tool_choice is ToolChoiceMode.NONE


@pytest.mark.parametrize(("choice", "says"), [
    ("always", "must be 'none', 'auto', 'required'"),
    (3, "got int"),
    ({"type": "function", "function": {}}, "function.name: Field required"),
    ({"type": "function", "function": {"name": "bad name"}}, "function.name: String should match pattern"),
])
def test_malformed_tool_choice(choice: Any, says: str) -> None:
    loc, msg = error_of(tools=[WEATHER], tool_choice=choice)
    assert loc == ("tool_choice",) and says in msg


# --- forced choice: the grammar's schema and its output ------------------------------------------

def test_required_schema_accepts_calls_to_any_tool_and_nothing_else() -> None:
    schema = tool_call_schema(tools(WEATHER, TIMER, NO_ARGS), ToolChoiceMode.REQUIRED)
    assert schema is not None
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    valid = [
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
        [{"name": "set_timer", "parameters": {"seconds": 5, "unit": "s"}}, {"name": "get_time", "parameters": {}}],
    ]
    invalid = [
        [],  # at least one call
        {"name": "get_time", "parameters": {}},  # an array, not one object
        [{"name": "get_wether", "parameters": {"city": "Paris"}}],  # unknown name
        [{"name": "get_weather", "parameters": {}}],  # a required argument missing
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "s"}}],  # the other tool's $defs
        [{"name": "set_timer", "parameters": {"seconds": 5, "unit": "celsius"}}],
        [{"name": "get_time", "parameters": {"x": 1}}],  # no parameters means none
        [{"name": "get_time", "parameters": {}, "extra": 1}],
        [{"name": "set_timer", "parameters": {"city": "Paris"}}],  # one tool's name, another's arguments
    ]
    assert [validator.is_valid(v) for v in valid] == [True] * len(valid)
    assert [validator.is_valid(v) for v in invalid] == [False] * len(invalid)


def test_named_and_single_call_schemas() -> None:
    weather = tools(WEATHER, TIMER)
    named = tool_call_schema(weather, NamedToolChoice.model_validate({"function": {"name": "get_weather"}}))
    assert named == WEATHER["function"]["parameters"]
    validator = Draft202012Validator(named)
    assert validator.is_valid({"city": "Rome"}) and not validator.is_valid({"seconds": 3})
    single = tool_call_schema(weather, ToolChoiceMode.REQUIRED, parallel_tool_calls=False)
    assert single is not None and single["maxItems"] == 1
    call = {"name": "set_timer", "parameters": {"seconds": 1}}
    assert not Draft202012Validator(single).is_valid([call, call])
    assert tool_call_schema(weather, ToolChoiceMode.AUTO) is None
    assert tool_call_schema(weather, ToolChoiceMode.NONE) is None
    assert tool_call_schema(weather, None) is None


def test_forced_output_becomes_calls() -> None:
    available = tools(WEATHER, TIMER)
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "set_timer", "parameters": {"seconds": 9}}]')
    calls = parse_forced_output(text, available, ToolChoiceMode.REQUIRED)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("set_timer", {"seconds": 9})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    # cut by max_tokens: the calls completed before the cut
    assert [c.name for c in parse_forced_output(text[:70], available, ToolChoiceMode.REQUIRED)] == ["get_weather"]
    named = NamedToolChoice.model_validate({"function": {"name": "set_timer"}})
    [call] = parse_forced_output('{"seconds": 30}', available, named)
    assert (call.name, call.arguments) == ("set_timer", '{"seconds": 30}')
    assert parse_forced_output("", available, named) == []
    with pytest.raises(ValueError):
        parse_forced_output(text, available, ToolChoiceMode.AUTO)


@pytest.fixture(scope="module")
def ll_tokenizer(default_model_dir) -> Any:
    hf = pytest.importorskip("llguidance.hf")
    return hf.from_tokenizer(Tokenizer(default_model_dir).hf)


def test_llguidance_enforces_the_required_schema(ll_tokenizer: Any, default_model_dir) -> None:
    """The schema compiles in llguidance, and its matcher takes a valid output token by token and
    refuses one that names a tool's argument from the other tool (`$defs` kept apart)."""
    from llguidance import LLMatcher

    tokenizer = Tokenizer(default_model_dir)
    grammar = LLMatcher.grammar_from_json_schema(tool_call_schema(tools(WEATHER, TIMER), ToolChoiceMode.REQUIRED))
    assert LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""

    def matches(text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    assert matches('[{"name": "set_timer", "parameters": {"seconds": 4, "unit": "s"}}]')
    assert not matches('[{"name": "set_timer", "parameters": {"seconds": 4, "unit": "celsius"}}]')
    assert not matches('[{"name": "get_time", "parameters": {}}]')


# --- auto parsers -------------------------------------------------------------------------------

def test_hermes_whole_text() -> None:
    hermes = tool_parser("hermes")
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time"}</tool_call>\n')
    content, calls = hermes.parse(text)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    bad = 'Hi <tool_call>{"name": "f", "arguments": {oops}</tool_call> there'
    assert hermes.parse(bad) == (bad, [])  # not JSON: stays content, tags and all
    assert hermes.parse('<tool_call>{"arguments": {}}</tool_call>').calls == []  # no name
    # the model stopped before the end tag
    [open_call] = hermes.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n').calls
    assert (open_call.name, open_call.arguments) == ("f", '{"x": 1}')
    assert hermes.parse("a < b, and <tool_c") == ("a < b, and <tool_c", [])
    assert hermes.parse("  plain text\n") == ("  plain text\n", [])
    # whitespace that only separates calls from each other or from the ends is not content
    assert hermes.parse('Hi <tool_call>{"name": "f"}</tool_call> there').content == "Hi there"
    assert hermes.parse('<tool_call>{"name": "f"}</tool_call>\n\nDone. ').content == "Done. "
    assert hermes.parse('Hi\n<tool_call>{"name": "f"}</tool_call>\n \n').content == "Hi"


def test_llama3_json_whole_text() -> None:
    llama = tool_parser("llama3_json")
    content, calls = llama.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                 '{"name": "get_time", "parameters": {}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}'),
                                                                       ("get_time", "{}")]
    assert llama.parse('{"name": "f", "parameters": {"s": "}{"}}').calls[0].arguments == '{"s": "}{"}'
    for text in ('The answer is {"name": "f"}', '{"nom": "f"}', '{"name": "f", "parameters": [1]}',
                 '  {"name": "f", "parameters": {', "<|python_tag|>print(1)", ""):
        assert llama.parse(text) == (text, [])
    content, calls = llama.parse('{"name": "f", "parameters": {}};\nDone. {bad')
    assert content == "Done. {bad" and [c.name for c in calls] == ["f"]


def test_output_nested_past_the_json_bound_is_content_not_a_crash() -> None:
    """A model's output nested deeper than `MAX_JSON_DEPTH` (past Python's parser: RecursionError, a 500)."""
    def call(depth: int) -> str:  # the call object itself, its arguments, then `depth - 2` arrays
        return '{"name": "f", "arguments": {"x": ' + "[" * (depth - 2) + "]" * (depth - 2) + "}}"

    within = call(MAX_JSON_DEPTH)
    for text in (call(2000), call(MAX_JSON_DEPTH + 1)):
        assert tool_parser("hermes").parse(f"<tool_call>{text}</tool_call>").calls == []
        assert tool_parser("llama3_json").parse(text) == (text, [])
    assert [c.name for c in tool_parser("hermes").parse(f"<tool_call>{within}</tool_call>").calls] == ["f"]
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels"):
        loads_json("[" * 5000)


def test_parsers_by_name() -> None:
    assert tool_parser("hermes").name == "hermes" and tool_parser("llama3_json").name == "llama3_json"
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json"):
        tool_parser("mistral")


def test_stream_holds_back_a_possible_tag() -> None:
    stream = tool_parser("hermes").stream()
    assert [d.openai() for d in stream.feed("Hello <tool")] == [{"content": "Hello"}]
    assert stream.feed('_call>{"name": "get_time", "arguments": {}}') == []
    first, args = stream.feed("</tool_call>")
    assert first.openai()["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert first.openai()["tool_calls"][0]["id"].startswith("call_")
    assert first.openai()["tool_calls"][0]["type"] == "function"
    assert args.openai() == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert stream.finish() == [] and [c.name for c in stream.calls] == ["get_time"]


def assemble(deltas: list[Delta]) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls a client rebuilds, checking the deltas' shape on the way."""
    content, calls, ids = "", [], []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text
            content += delta.text
            continue
        assert isinstance(delta, ToolCallDelta)
        if delta.id is not None:  # a call's first delta: the next index, its id and name, no arguments
            assert delta.index == len(calls) and delta.name and delta.arguments == ""
            assert delta.id.startswith("call_") and delta.id not in ids
            ids.append(delta.id)
            calls.append((delta.name, ""))
        else:
            assert delta.index == len(calls) - 1
            calls[-1] = (calls[-1][0], calls[-1][1] + delta.arguments)
    return content, calls


def streamed(stream: ToolStreamParser, chunks: list[str]) -> list[Delta]:
    deltas = [d for chunk in chunks for d in stream.feed(chunk)]
    return deltas + stream.finish()


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


HERMES_PIECES = ["Sure, ", "checking.", "\n", "  ", "<", "<tool", "<tool_call>", "</tool_call>", "{", "}", '"', ";",
                 '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}', '{"name": 1}', "{not json",
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "done"]
LLAMA_PIECES = ["<|python_tag|>", "<|py", " ", "\n", ";", "; ", '{"name": "a", "parameters": {"s": "}{\\""}}',
                '{"name": "b"}', '{"nom": 1}', "{", "}", '"', "text", "Done."]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["hermes", "llama3_json"]), st.data())
def test_streaming_matches_whole_text_in_any_chunking(name: str, data: st.DataObject) -> None:
    pieces = st.sampled_from(HERMES_PIECES if name == "hermes" else LLAMA_PIECES) | st.text(max_size=4)
    text = "".join(data.draw(st.lists(pieces, max_size=12)))
    chunks = split(text, data.draw(st.lists(st.integers(min_value=0), max_size=12)))
    parser = tool_parser(name)
    whole = parser.parse(text)
    stream = parser.stream()
    content, calls = assemble(streamed(stream, chunks))
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert [(c.name, c.arguments) for c in stream.calls] == calls


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["required", "named"]), st.data())
def test_forced_streaming_matches_whole_text(kind: str, data: st.DataObject) -> None:
    available = tools(WEATHER, TIMER)
    choice = ToolChoiceMode.REQUIRED if kind == "required" else NamedToolChoice.model_validate(
        {"function": {"name": "get_weather"}})
    text = (' [{"name": "get_weather", "parameters": {"city": "a}]"}} ,\n{"name": "set_timer", "parameters": '
            '{"seconds": 2}}]' if kind == "required" else ' {"city": "Paris", "unit": "celsius"}')
    text = text[:data.draw(st.integers(min_value=0, max_value=len(text)))]  # any cut, as max_tokens makes
    chunks = split(text, data.draw(st.lists(st.integers(min_value=0), max_size=8)))
    content, calls = assemble(streamed(forced_stream_parser(available, choice), chunks))
    assert content == ""
    assert calls == [(c.name, c.arguments) for c in parse_forced_output(text, available, choice)]


def test_finish_reason() -> None:
    assert chat_finish_reason("stop", produced_calls=True) == "tool_calls"
    assert chat_finish_reason("stop", produced_calls=False) == "stop"
    assert chat_finish_reason("length", produced_calls=True) == "length"
    assert chat_finish_reason(None, produced_calls=True) is None


# --- chat template side -------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
]


def test_smollm_template_gets_the_hermes_fallback(default_model_dir) -> None:
    tokenizer = Tokenizer(default_model_dir)
    support = inspect_chat_template(tokenizer.hf.chat_template)
    assert not support.native and support.parser == "hermes"
    rendered = render_messages(HISTORY, tools(WEATHER), tokenizer_has_tools_support=support.native)
    assert rendered.tools is None and rendered.parser == "hermes"
    text = tokenizer.apply_chat_template(rendered.messages)
    weather_json = json.dumps(WEATHER, ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert f"<tools>\n{weather_json}\n</tools>" in text
    assert "return a json object with function name and arguments within <tool_call></tool_call> XML tags" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # the calls as rendered are what the parser reads back
    assistant_turn = rendered.messages[2]["content"]
    assert [(c.name, c.arguments) for c in tool_parser("hermes").parse(assistant_turn).calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]


def test_fallback_without_a_system_message_replaces_the_default_one(default_model_dir) -> None:
    text = Tokenizer(default_model_dir).apply_chat_template(
        render_messages([{"role": "user", "content": "Time?"}], tools(NO_ARGS), False).messages)
    assert text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in text
    plain = render_messages([{"role": "user", "content": "Hi"}], None, False).messages
    assert plain == [{"role": "user", "content": "Hi"}]


# A template of the Qwen2.5 kind (it renders `tools` and decoded `arguments` itself), kept short.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}")


def test_native_template_gets_tools_and_decoded_arguments(default_model_dir) -> None:
    support = inspect_chat_template(TOOLS_TEMPLATE)
    assert support.native and support.parser == "hermes"
    rendered = render_messages(HISTORY, tools(WEATHER, NO_ARGS), support.native, support.parser)
    assert rendered.tools == [WEATHER, NO_ARGS]
    assert rendered.messages[2]["tool_calls"][1] == {
        "id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    assert rendered.messages[3] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    text = Tokenizer(default_model_dir).hf.apply_chat_template(
        rendered.messages, tools=rendered.tools, chat_template=TOOLS_TEMPLATE, tokenize=False)
    assert f"<|im_start|>system\n{json.dumps(WEATHER)}\n" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text


def test_malformed_history_calls_name_the_message() -> None:
    broken = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.name: Field required"):
        render_messages(broken, None, False)
    cut = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": '{"x": '}}]}]  # replayed from a cut output
    assert '"arguments": "{\\"x\\": "' in render_messages(cut, None, False).messages[0]["content"]
