"""POST /tokenize, POST /detokenize and GET /version on the real `kvbaton serve` process, checked against
the checkpoint's own tokenizer (transformers, loaded here from the same directory)."""

from __future__ import annotations

import httpx
import pytest

import kvbaton
from tests.support.server import kvbaton_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024  # the default_server fixture's --max-model-len
VOCAB_SIZE = 49152
TEXTS = ["The three primary colors are", "  leading spaces, a\ttab and\nnew lines\n", "Grüße, 東京 🚀 — naïve café"]
MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def _post(base: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60, **kwargs)


def _template_ids(hf_tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_and_detokenize_round_trip_as_the_tokenizer_does(default_server, hf_tokenizer, text):
    r = _post(default_server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": MAX_MODEL_LEN, "tokens": hf_tokenizer.encode(text)}
    back = _post(default_server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": hf_tokenizer.decode(body["tokens"])} == {"prompt": text}
    plain = _post(default_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)


def test_detokenize_keeps_special_tokens(default_server, hf_tokenizer):
    ids = _template_ids(hf_tokenizer, MESSAGES, add_generation_prompt=True)
    r = _post(default_server, "/detokenize", {"tokens": ids})
    assert r.json() == {"prompt": hf_tokenizer.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].startswith("<|im_start|>system")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_tokenize_equals_the_chat_templates_ids(default_server, hf_tokenizer, add_generation_prompt):
    r = _post(default_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == _template_ids(hf_tokenizer, MESSAGES, add_generation_prompt)
    assert r.json()["count"] == len(r.json()["tokens"])


def test_tokenize_counts_what_generation_is_charged(default_server):
    """The ids are those a generation request is given: its usage.prompt_tokens is /tokenize's count."""
    count = _post(default_server, "/tokenize", {"messages": MESSAGES}).json()["count"]
    chat = _post(default_server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == count
    count = _post(default_server, "/tokenize", {"prompt": TEXTS[0]}).json()["count"]
    completion = _post(default_server, "/v1/completions", {"model": MODEL, "prompt": TEXTS[0], "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == count


BAD = [
    ("/detokenize", {"tokens": [1, VOCAB_SIZE]}, 400, "tokens"),  # just past the vocabulary
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**30]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": "word " * (MAX_MODEL_LEN + 1)}, 400, "prompt"),  # too many tokens
    ("/tokenize", {"prompt": "x" * 2_000_000}, 400, "prompt"),  # refused by length before it is tokenized
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": 1}, 400, "add_generation_prompt"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_is_an_openai_error_naming_the_field_and_the_server_serves_on(default_server, path, body, status,
                                                                                 param):
    r = _post(default_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"], error
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert _post(default_server, "/tokenize", {"prompt": "still here"}).status_code == 200


def test_a_lone_surrogate_is_refused_by_name(default_server):
    r = httpx.post(f"{default_server}/tokenize", content=b'{"prompt": "a\\ud800b"}', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_after_the_bad_inputs_generation_still_works(default_server):
    r = _post(default_server, "/v1/completions", {"model": MODEL, "prompt": TEXTS[0], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{default_server}/health", timeout=10).status_code == 200


def test_version(default_server):
    r = httpx.get(f"{default_server}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": kvbaton.__version__}


def test_models_report_max_model_len(default_server):
    card = httpx.get(f"{default_server}/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_routes_need_the_api_key_and_version_does_not(default_model_dir):
    with kvbaton_server("--dtype", "float32", "--max-model-len", "256", "--api-key", "s3cret") as (base, _):
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [6004]})]:
            for headers in ({}, {"Authorization": "Bearer nope"}):
                r = _post(base, path, body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", r.text
            assert _post(base, path, body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert _post(base, "/tokenize", {"prompt": "hi"}, headers={"Authorization": "Bearer s3cret"}).json() == {
            "count": 1, "max_model_len": 256, "tokens": [6004]}
        assert httpx.get(f"{base}/version", timeout=10).json() == {"version": kvbaton.__version__}
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
