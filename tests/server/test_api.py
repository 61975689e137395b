"""The real `kvbaton serve` process, driven with the official `openai` client and raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server import kvbaton_server, wait_idle
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=120)


def _stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=10).json()


def test_completion_streamed_equals_whole_and_offline_engine(client, default_model_dir):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
    from kvbaton import LLM, SamplingParams

    llm = LLM(str(default_model_dir), dtype="float32")
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0]
    assert whole.choices[0].text == offline.outputs[0].text
    assert whole.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_chat_streamed_equals_whole(client):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, temperature=0)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content and text
    assert stream[-1].usage.total_tokens == whole.usage.total_tokens
    assert whole.usage.completion_tokens == whole.usage.total_tokens - whole.usage.prompt_tokens


def test_a_whole_body_of_many_logprobs_is_rendered_off_the_loop_as_streamed(client):
    # 4 choices x 25 positions x (1 + 20): over RENDER_OFF_LOOP_ENTRIES, so the whole body is built in a thread
    from kvbaton.server.api import RENDER_OFF_LOOP_ENTRIES

    assert 4 * 25 * 21 >= RENDER_OFF_LOOP_ENTRIES
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=25, temperature=0, n=4, logprobs=20,
                extra_body={"ignore_eos": True})
    whole = {c.index: c.logprobs for c in client.completions.create(**args).choices}
    streamed: dict[int, list] = {i: [] for i in range(4)}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed[c.index] += list(zip(c.logprobs.tokens, c.logprobs.top_logprobs)) if c.logprobs else []
    assert sorted(whole) == [0, 1, 2, 3] and all(len(whole[i].tokens) == 25 for i in whole)
    for i in whole:
        assert [token for token, _ in streamed[i]] == whole[i].tokens
        # NOTE: two requests, whose batches may differ: their values agree to float32 noise, and a near-tie at
        # the 20th place may swap one top token for another
        for (_, top), whole_top in zip(streamed[i], whole[i].top_logprobs):
            shared = set(top) & set(whole_top)
            assert len(shared) >= len(whole_top) - 2
            assert all(top[t] == pytest.approx(whole_top[t], abs=1e-4) for t in shared)
        assert all(len(top) >= 19 for top in whole[i].top_logprobs)  # 20, but for tokens whose texts coincide


def test_logprobs_stop_and_seed(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(v <= 0 for v in lp.token_logprobs) and len(lp.top_logprobs[0]) == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2, 3"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 5 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    word = full.split()[1]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text
    assert full.startswith(cut.choices[0].text)
    a, b = (client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_models_health_metrics(default_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{default_server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{default_server}/metrics").text
    for name in ("kvbaton:time_to_first_token_seconds", "kvbaton:inter_token_latency_seconds",
                 "kvbaton:e2e_request_latency_seconds", "kvbaton:request_queue_time_seconds",
                 "kvbaton:prompt_tokens_total", "kvbaton:generation_tokens_total", "kvbaton:num_requests_running",
                 "kvbaton:num_requests_waiting", "kvbaton:kv_cache_usage_perc", "kvbaton:prefix_cache_hit_rate",
                 "kvbaton:num_preemptions"):
        assert name in text, name


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 1100}, 400, "prompt"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(default_server, client, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{default_server}/v1/completions", headers={"Content-Type": "application/json"}, timeout=30,
                   **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["code"] == status
    if param:
        assert error["param"] == param, error
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    wait_idle(default_server)


def test_client_disconnect_mid_stream_frees_blocks(default_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{default_server}/v1/completions", json=body, timeout=60) as r:
        # NOTE: keep the line iterator referenced: once it is garbage, httpx closes the connection, the
        # server sees the client leave, and the request is aborted before the check below can see it run.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break  # streaming has begun; 2000 tokens leave tens of seconds before it could finish
        # /stats is the workers' last heartbeat, so it may lag the first token by an interval.
        wait_until(lambda: _stats(default_server)["num_running"] == 1, 10.0,
                   message=lambda: f"the stream is not running: {_stats(default_server)}")
        assert _stats(default_server)["num_running"] == 1
    stats = wait_idle(default_server)
    assert stats["num_in_flight"] == 0


def test_api_key(default_model_dir):
    with kvbaton_server("--dtype", "float32", env={"KVBATON_API_KEY": "s3cret"}) as (base, _):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        bad = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "AuthenticationError"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200


def test_stats_and_workers_name_the_compute_path(default_server):
    """The path the table chose for this CPU (kvbaton.platform.compute), as the engine logged it at start."""
    from kvbaton.kernels.linear import amx_enabled
    from kvbaton.platform.compute import choose_compute_plan
    from kvbaton.platform.cpu import detect_cpu

    # the server fixture runs fp32
    expected = choose_compute_plan(detect_cpu(), "float32", amx_granted=amx_enabled()).summary()
    assert _stats(default_server)["compute_path"] == expected
    workers = httpx.get(f"{default_server}/workers", timeout=10).json()
    rows = workers if isinstance(workers, list) else workers.get("workers", [])
    assert rows and all(w["compute_path"] == expected for w in rows)
