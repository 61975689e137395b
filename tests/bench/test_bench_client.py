"""The client against scripted HTTP responses (httpx.MockTransport): no sockets, no server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvbaton.bench.client import Target, send_request
from kvbaton.workload.datasets import BenchRequest
from kvbaton.workload.errors import WorkloadError

REQ = BenchRequest(0, "hello there", 2, 3, system="be brief", group=0)


def _sse(*chunks: object) -> bytes:
    return "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks).encode()


def _text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"text": t, "finish_reason": finish}]}


def _send(body: bytes, status: int = 200, target: Target | None = None):
    target = target or Target("http://127.0.0.1:1", "/v1/completions", "m")
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, target, REQ, run_start=0.0, scheduled_s=0.0)

    return asyncio.run(go())


def test_payload_for_completions_and_chat():
    t = Target("http://h:1/", "/v1/completions", "m", api_key="k", extra_body={"top_k": 1})
    body = t.payload(REQ)
    assert body["prompt"] == "be brief\n\nhello there" and "ignore_eos" not in body
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["top_k"]) == (3, 0.0, 1)
    assert t.url == "http://h:1/v1/completions"
    assert t.headers() == {"Connection": "close", "Authorization": "Bearer k"}
    chat = Target("http://h:1", "/v1/chat/completions", "m", ignore_eos=True, keepalive=True)
    assert chat.payload(REQ)["messages"] == [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello there"}]
    assert chat.payload(REQ)["ignore_eos"] is True and chat.headers() == {}


def test_target_validation():
    with pytest.raises(WorkloadError):
        Target("http://h", "/v1/embeddings", "m")
    with pytest.raises(WorkloadError):
        Target("127.0.0.1:8000", "/v1/completions", "m")


def test_usage_gives_token_counts_and_each_chunk_an_itl():
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    rec = _send(_sse(_text("a"), _text("b"), _text("c", "length"), usage, "[DONE]"))
    assert rec.ok and rec.output_tokens == 3 and rec.prompt_len == 9 and len(rec.itl_s) == 2
    assert 0 <= rec.ttft_s <= rec.e2e_s and rec.http_status == 200


def test_without_usage_tokens_are_counted_chunks_and_dataset_length_is_kept():
    rec = _send(_sse(_text(""), _text("a"), _text("b", "stop"), "[DONE]"))
    assert rec.ok and rec.output_tokens == 2 and rec.prompt_len == REQ.prompt_len


def test_a_finish_reason_without_done_still_completes():
    assert _send(_sse(_text("a"), _text("b", "stop"))).ok


def test_a_stream_cut_before_its_end_is_an_error():
    rec = _send(_sse(_text("a"), _text("b")))
    assert rec.status == "error" and "ended" in rec.error


def test_an_error_event_mid_stream_is_an_error():
    rec = _send(_sse(_text("a"), {"error": {"message": "engine died"}}))
    assert rec.status == "error" and rec.error == "engine died"


@pytest.mark.parametrize("status,expected", [(429, "rejected"), (503, "rejected"), (500, "error"), (404, "error")])
def test_http_status_is_classified(status, expected):
    rec = _send(b'{"error": "nope"}', status=status)
    assert rec.status == expected and rec.http_status == status and "nope" in rec.error


def test_connection_errors_become_records_and_keepalive_retries_once():
    calls = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers.get("connection"))
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=_sse(_text("a", "stop"), "[DONE]"))

    async def go(keepalive: bool):
        calls.clear()
        target = Target("http://127.0.0.1:1", "/v1/completions", "m", keepalive=keepalive)
        async with httpx.AsyncClient(transport=httpx.MockTransport(flaky)) as client:
            return await send_request(client, target, REQ, 0.0, 0.0)

    rec = asyncio.run(go(keepalive=False))
    assert rec.status == "error" and "RemoteProtocolError" in rec.error and len(calls) == 1
    rec = asyncio.run(go(keepalive=True))
    assert rec.ok and rec.attempts == 2 and len(calls) == 2
