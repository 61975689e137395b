"""Structured outputs in the engine, on the real default model: every kind of grammar is obeyed at
temperature 1 over many seeds (JSON validated against its schema with `jsonschema`), requests without
a grammar are unharmed by those with one in the same batch, a bad grammar is refused naming the field,
and a request resumed on another engine from prompt + its output so far (what the router does after a
failover) rebuilds its matcher from those tokens and goes on exactly as it would have."""

from __future__ import annotations

import gc
import json
import re
import threading
import weakref

import jsonschema
import llguidance
import pytest

from kvbaton import LLM
from kvbaton.engine.structured.admission import GrammarAdmission
from kvbaton.engine.structured.grammar import GrammarCompiler
from kvbaton.engine.structured.matchers import GrammarMatchers
from kvbaton.sched.grammar_spec import StructuredOutput
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Describe a user of our website as JSON."}]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", max_model_len=1024)


def test_json_schema_always_validates_at_temperature_one(llm) -> None:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                             structured_output=StructuredOutput.json_schema(PERSON)) for seed in range(10)]
    outs = llm.chat([QUESTION] * len(params), params[0])  # one seed first: the shared compiled grammar
    outs = llm.generate([{"prompt_token_ids": outs[0].prompt_token_ids}] * len(params), params)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.parametrize(("spec", "check"), [
    (StructuredOutput("regex", r"\d{3}-\d{4}"), lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
    (StructuredOutput.choice(["Paris", "London", "Rome"]), lambda text: text in ("Paris", "London", "Rome")),
    (StructuredOutput("grammar", 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'),
     lambda text: re.fullmatch(r"The answer is [0-9]{1,3}\.", text)),
    (StructuredOutput("grammar", 'root ::= "yes" | "no"'), lambda text: text in ("yes", "no")),  # GBNF
    (StructuredOutput.json_schema({"type": "object"}), lambda text: isinstance(json.loads(text), dict)),
])
def test_each_kind_of_grammar_is_obeyed(llm, spec, check) -> None:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_output=spec) for seed in range(4)]
    outs = llm.generate([{"prompt_token_ids": llm.get_tokenizer().encode("Tell me something: ")}] * 4, params)
    for out in outs:
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "length":
            assert spec.text == '{"type":"object"}', text  # only open-ended JSON may run out of tokens
            continue
        assert check(text), text


def test_requests_without_a_grammar_are_unharmed_in_the_same_batch(llm) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Count to five.")]
    alone = [o.outputs[0].token_ids for o in llm.chat(prompts, plain)]
    structured = SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput.json_schema(PERSON))
    mixed_prompts = [{"prompt_token_ids": o.prompt_token_ids} for o in llm.chat(prompts, plain)]
    question = llm.chat([QUESTION], plain)[0].prompt_token_ids
    outs = llm.generate(mixed_prompts + [{"prompt_token_ids": question}] * 2, [plain, plain, structured, structured])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for o in outs[2:]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutput("regex", "(unclosed"), "invalid regex"),
    (StructuredOutput("json", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), "invalid json"),
    (StructuredOutput("json", "[1, 2]"), "invalid json"),
    (StructuredOutput("grammar", "start: undefined_rule"), "invalid grammar"),
    (StructuredOutput("choice", "[]"), "invalid choice"),
])
def test_bad_grammar_is_refused_naming_the_field(llm, spec, message) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.generate("hello", SamplingParams(structured_output=spec))
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the engine goes on


class _Caller:
    """Stands for what a caller's frame holds (its request, its engine)."""


def test_a_refused_spec_keeps_nothing_of_its_callers(llm) -> None:
    """A bad spec is refused from the cache, to each caller with an error of its own: the cache holds none of
    their frames. (It once kept the exception it raised to every caller, whose traceback grew by each caller's
    frames: repeated bad schemas grew the process, and an engine that had refused one was never freed.)"""
    core = llm.engine.core
    compiler = GrammarCompiler.for_tokenizer(Tokenizer(core.model_dir).backend.to_str, core.info.vocab_size,
                                             core.info.eos_token_ids)
    spec, errors = StructuredOutput("regex", "(unclosed"), []

    def validate(caller: _Caller) -> None:  # `caller` lives in this frame, as a request does in a server's
        try:
            compiler.validate(spec)
        except InvalidRequestError as exc:
            errors.append(exc)

    try:
        caller = _Caller()
        alive = weakref.ref(caller)
        for _ in range(3):  # the first while the compiler still builds its tokenizer, then from the cache
            validate(caller)
        assert len({id(e) for e in errors}) == 3 and all("invalid regex" in str(e) for e in errors), errors
        del caller
        errors.clear()
        gc.collect()
        assert alive() is None, "the compiler's cache keeps a caller's frame alive"
    finally:
        compiler.close()


def test_resumed_request_rebuilds_its_matcher_from_its_tokens(llm) -> None:
    spec = StructuredOutput.json_schema(PERSON)
    question = llm.chat([QUESTION], SamplingParams(max_tokens=1))[0].prompt_token_ids
    whole = llm.generate({"prompt_token_ids": question},
                         SamplingParams(temperature=0.0, max_tokens=80, structured_output=spec))[0].outputs[0]
    assert whole.finish_reason == "stop"
    done = 7  # the tokens a first attempt had already streamed when its worker died
    resumed = llm.generate({"prompt_token_ids": question + whole.token_ids[:done]},
                           SamplingParams(temperature=0.0, max_tokens=80 - done, structured_output=spec,
                                          resumed_output_tokens=done))[0].outputs[0]
    assert whole.token_ids[:done] + resumed.token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text), PERSON)


def test_a_compiling_grammar_holds_only_its_own_request(llm) -> None:
    """The engine core as a worker drives it. The compiler's tokenizer is held back by a gate: the structured
    request waits outside the scheduler while a plain one runs to its end, then runs once its grammar is ready."""
    core, gate = llm.engine.core, threading.Event()
    model_dir, info = core.model_dir, core.info

    def gated_compiler() -> GrammarCompiler:
        def tokenizer():
            assert gate.wait(120)
            return llguidance.LLTokenizer(Tokenizer(model_dir).backend.to_str(), n_vocab=info.vocab_size,
                                          eos_token=list(info.eos_token_ids))

        compiler = GrammarCompiler(tokenizer)
        core.runner.grammars = GrammarMatchers(compiler, info.vocab_size, info.eos_token_ids)
        return compiler

    saved = core.grammars, core.runner.grammars
    core.grammars = GrammarAdmission(gated_compiler)
    try:
        question = llm.chat([QUESTION], SamplingParams(max_tokens=1))[0].prompt_token_ids
        structured = SamplingParams(temperature=0.0, max_tokens=80,
                                    structured_output=StructuredOutput.json_schema(PERSON))
        core.add_request(core.new_request("held", question, structured))
        core.add_request(core.new_request("plain", question, SamplingParams(temperature=0.0, max_tokens=8)))
        tokens: dict[str, list[int]] = {"held": [], "plain": []}
        finished: set[str] = set()
        for _ in range(200):
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finished.add(out.request_id)
            if "plain" in finished:
                break
        assert finished == {"plain"} and not tokens["held"]
        assert "held" in core.grammars and core.scheduler.num_waiting + core.scheduler.num_running == 0
        gate.set()
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
        text = llm.get_tokenizer().decode(tokens["held"], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), PERSON)
    finally:
        gate.set()
        core.grammars.close()
        core.grammars, core.runner.grammars = saved


def test_properties_come_in_the_schemas_order(llm) -> None:
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 40},
                                               "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    question = llm.chat([[{"role": "user", "content": "What is 1 + 1? Reply as JSON."}]],
                        SamplingParams(max_tokens=1))[0].prompt_token_ids
    out = llm.generate({"prompt_token_ids": question}, SamplingParams(
        temperature=0.0, max_tokens=60, structured_output=StructuredOutput.json_schema(schema)))[0].outputs[0]
    assert list(json.loads(out.text)) == ["reasoning", "answer"], out.text
