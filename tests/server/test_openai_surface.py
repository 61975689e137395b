"""The vLLM/OpenAI API surface through the real server process and the official `openai` client, in
colocated mode and with `--prefill 1 --decode 1` (every request then prefilled on one worker, whose
first token must obey the grammar too, and decoded on the other): structured outputs, tool calls,
penalties and logit_bias, n > 1, prompt batches, echo, stop_reason, and the 400s of bad input."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.server import kvbaton_server
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def pd_server(default_model_dir):
    with kvbaton_server("--dtype", "float32", "--max-model-len", "1024", "--prefill", "1", "--decode", "1",
                        "--local-prefill-threshold", "0", "--kv-transport", "tcp") as (url, _):
        yield url


@pytest.fixture(params=["colocated", "pd"])
def base(request, default_server):
    """Both placements: for what the prefill / decode split could break (the first token, the matcher)."""
    return default_server if request.param == "colocated" else request.getfixturevalue("pd_server")


# For what the frontend alone does (the fan-out of n and of prompt batches, templates, the tool parser, the logits
# processors' arguments): the split adds nothing there that the structured-output cases do not cover already.
colocated_only = pytest.mark.parametrize("base", ["colocated"], indirect=True)


@pytest.fixture
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)




def _person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_response_format_always_validates_at_temperature_one(client) -> None:
    """Many seeds at temperature 1 (n samples: seed, seed + 1, ...), whole and streamed."""
    ask = [{"role": "user", "content": "Describe a user of our website as JSON."}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, response_format=_person_format(), n=8,
                                           seed=7, temperature=1.0, max_tokens=100)
    assert sorted(c.index for c in whole.choices) == list(range(8))
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, response_format=_person_format(), n=4,
                                                seed=11, temperature=1.0, max_tokens=100, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == list(range(4))
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_parse_with_a_pydantic_model_and_json_mode(client) -> None:
    class Cat(BaseModel):
        name: str
        age: int

    parsed = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A cat, as JSON."}],
                                                response_format=Cat, max_tokens=60, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Cat)
    mode = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A dog, as JSON."}],
                                          response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(mode.choices[0].message.content), dict)


@pytest.mark.parametrize(("structured", "check"), [
    ({"choice": ["Paris", "London", "Rome"]}, lambda t: t in ("Paris", "London", "Rome")),
    ({"regex": r"[A-Z][a-z]{2,8} is the capital\."}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} is the capital\.", t)),
    ({"grammar": 'start: "Answer: " ("yes" | "no")'}, lambda t: t in ("Answer: yes", "Answer: no")),
])
def test_vllm_structured_outputs_extension(client, structured, check) -> None:
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=60, temperature=1.0, seed=3, n=2,
                      extra_body={"structured_outputs": structured})
        if stream:
            texts: dict[int, str] = {}
            for chunk in client.completions.create(**kwargs, stream=True):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
            outs = list(texts.values())
        else:
            outs = [c.text for c in client.completions.create(**kwargs).choices]
        assert len(outs) == 2
        for text in outs:
            assert check(text), text


def _check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_whole_and_streamed(client, tool_choice) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice=tool_choice,
                                           max_tokens=80, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[TIME, WEATHER],
                                                tool_choice=tool_choice, max_tokens=80, temperature=0, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] = (delta.function.name if delta.function else None) or entry["name"]
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


@colocated_only
def test_tool_history_is_rendered_and_answered(client) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=30, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content
    assert not out.choices[0].message.tool_calls


@colocated_only
def test_auto_tool_calls_parsed_from_the_models_text(client) -> None:
    # the model is shown one call of the convention (the Hermes fallback its template gets) and asked again:
    # a 135M model copies the pattern, and the parser must turn its <tool_call> text into tool_calls
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
        {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="auto",
                                         max_tokens=60, temperature=0)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert "<tool_call>" not in (choice.message.content or "")
        _check_call(choice.message.tool_calls[0], WEATHER)
    else:  # the model answered in text: that text must not hide a call the parser missed
        assert "<tool_call>" not in (choice.message.content or ""), choice.message.content


@colocated_only
def test_n_prompt_batches_echo_and_stop_reason(client) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    singles = [a.choices[0].text for a in alone]
    assert [c.text for c in batch.choices] == [singles[0], singles[0], singles[1], singles[1]]
    # OpenAI's usage: each prompt once, every choice's tokens
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    echoed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + singles[0]
    sampled = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1.0, seed=5, n=3)
    again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded: repeatable
    assert len({c.text for c in sampled.choices}) > 1  # seed, seed + 1, ...: the samples differ
    stop = singles[0].strip().split()[0]
    stopped = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra.get("stop_reason") == stop


@colocated_only
def test_penalties_min_p_and_logit_bias(client) -> None:
    prompt = "Repeat after me: apple apple apple apple"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]
    tokenized = httpx.post(f"{str(client.base_url).removesuffix('/v1/')}/tokenize",
                           json={"prompt": first, "add_special_tokens": False}, timeout=30)
    assert tokenized.status_code == 200, tokenized.text
    banned = tokenized.json()["tokens"][0]
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       logit_bias={str(banned): -100})
    assert not biased.choices[0].text.startswith(first)
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert penalized.choices[0].text != plain.choices[0].text
    neutral = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        presence_penalty=0.0, frequency_penalty=0.0, logit_bias={},
                                        extra_body={"repetition_penalty": 1.0, "min_p": 0.0})
    assert neutral.choices[0].text == plain.choices[0].text
    narrow = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=1,
                                       extra_body={"min_p": 1.0})  # only the top token survives: greedy
    assert narrow.choices[0].text == plain.choices[0].text


def test_async_client_streams_structured_output(base) -> None:
    async def scenario() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(seed: int) -> str:
            text = ""
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "A user, as JSON."}], seed=seed, temperature=1.0,
                response_format=_person_format(), max_tokens=100, stream=True)
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            return text

        try:
            return await asyncio.gather(*(one(seed) for seed in range(4)))
        finally:
            await client.close()

    for text in asyncio.run(scenario()):
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {  # a feature llguidance lacks
        "type": "object", "not": {"required": ["a"]}}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(?=look)ahead"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"tools": [WEATHER, WEATHER]}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, None),
    ({"n": 17}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"min_p": -0.5}, "min_p"),
])
def test_bad_input_is_a_400_and_the_server_keeps_serving(default_server, body, param) -> None:
    # colocated: the checks run in the frontend, before any worker (tests/server/test_hardening_api.py sends
    # these fields against PD serving too and checks no worker is harmed)
    base = default_server
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    resp = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param or (error["param"] or "").startswith(param), error
    ok = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_echo_with_logprobs_and_prompt_logprobs(client) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = echoed.choices[0].logprobs
    n_prompt = echoed.usage.prompt_tokens
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert "".join(lp.tokens) == echoed.choices[0].text
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert lp.tokens[n_prompt:] == plain.choices[0].logprobs.tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True, stream=True))
    assert streamed == echoed.choices[0].text
    asked = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 1})
    entries = asked.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == n_prompt
    # the prompt token's own logprob, as the echoed legacy format reports it
    assert [next(iter(e.values()))["logprob"] for e in entries[1:]] == pytest.approx(lp.token_logprobs[1:n_prompt],
                                                                                       abs=1e-4)


def test_generation_config_path_sets_defaults_and_eos(tmp_path, default_model_dir) -> None:
    from kvbaton.text.tokenizer import Tokenizer

    period = Tokenizer(default_model_dir).encode(".", add_special_tokens=False)[-1]
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 40, "eos_token_id": [2, period]}))
    with kvbaton_server("--dtype", "float32", "--max-model-len", "1024", "--generation-config",
                        str(tmp_path)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "Tell me about Paris in three sentences."}]
        first = client.chat.completions.create(model=MODEL, messages=ask)  # no temperature, no max_tokens
        again = client.chat.completions.create(model=MODEL, messages=ask)
        assert first.choices[0].message.content == again.choices[0].message.content  # its temperature 0
        assert first.choices[0].finish_reason == "stop" and first.choices[0].message.content.endswith(".")
        assert first.choices[0].message.content.count(".") == 1  # the period is an EOS of this config
        assert first.usage.completion_tokens <= 40


def test_n_samples_share_their_prompts_kv(default_server) -> None:
    """One sample computes the prompt's blocks; the others hit them in the prefix cache, also when all are
    admitted in the same step (the hit counter grows by (n - 1) x the prompt's full blocks). Colocated: with
    --prefill 1 --decode 1 the counter did not show the hits (the samples' prefills run on the prefill
    worker; whether they share there is not yet checked)."""
    base = default_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    words = " ".join(f"w{i}x{(i * 7919) % 1000}" for i in range(120))  # fresh: no earlier request shares it
    prompt = f"Summarise these words: {words}"

    def hit_tokens() -> int:
        return httpx.get(f"{base}/stats", timeout=10).json()["prefix_cache_hit_tokens"]

    before = hit_tokens()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=2, n=4)
    assert len(out.choices) == 4
    full_blocks = (out.usage.prompt_tokens - 1) // 16 * 16
    # the counters come with the workers' load reports
    wait_until(lambda: hit_tokens() - before >= 3 * full_blocks, 15.0, interval_s=0.2,
               message=lambda: f"{hit_tokens() - before} prefix-cache hit tokens, {3 * full_blocks} expected")
    assert hit_tokens() - before >= 3 * full_blocks
