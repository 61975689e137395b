"""The load generator end to end against a real local HTTP server (fake model, real sockets)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvbaton.bench.cli import run
from kvbaton.bench.client import Target, fetch_model_name
from kvbaton.bench.runner import run_load
from kvbaton.workload.arrivals import ArrivalConfig
from kvbaton.workload.datasets import DatasetConfig, WordPrompts, build_requests
from tests.support.fake_openai_server import MODEL, FakeOpenAIServer


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer() as srv:
        yield srv


def _run(server: FakeOpenAIServer, n: int, rate: float = float("inf"), concurrency: int | None = None,
         endpoint: str = "/v1/completions", max_duration_s: float | None = None, **target_kw):
    requests = build_requests(DatasetConfig(num_prompts=n, input_len=5, output_len=6), WordPrompts(), seed=0)
    target = Target(server.base_url, endpoint, MODEL, **target_kw)
    arrivals = ArrivalConfig(request_rate=rate, max_concurrency=concurrency)
    return asyncio.run(run_load(target, requests, arrivals, seed=0, max_duration_s=max_duration_s,
                                show_progress=False))


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_every_request_completes_with_exact_counts(server, endpoint):
    result = _run(server, 24, concurrency=6, endpoint=endpoint)
    assert len(result.records) == 24 and all(r.ok for r in result.records)
    for r in result.records:
        assert r.output_tokens == 6 and len(r.itl_s) == 5 and r.prompt_len == 7
        assert 0 < r.ttft_s < r.e2e_s and r.tpot_s > 0
    assert all(h.get("connection") == "close" for h in server.headers[-24:])
    body = server.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body


def test_open_loop_sends_on_schedule_and_concurrency_caps_in_flight(server):
    result = _run(server, 10, rate=50.0)
    lateness = [r.send_s - r.scheduled_s for r in result.records]
    assert max(lateness) < 0.2
    capped = _run(server, 6, concurrency=1, extra_body={"fake": {"delay_s": 0.01}})
    ordered = sorted(capped.records, key=lambda r: r.send_s)
    for before, after in zip(ordered, ordered[1:]):
        assert after.send_s >= before.send_s + before.e2e_s - 1e-3  # one at a time


def test_rejections_failures_and_drops_are_counted_separately(server):
    kinds = [{"reject": True}, {"fail": True}, {"drop_after": 2}, {"no_usage": True}]
    results = [_run(server, 3, extra_body={"fake": k}) for k in kinds]
    assert {r.status for r in results[0].records} == {"rejected"}
    assert {(r.status, r.http_status) for r in results[1].records} == {("error", 500)}
    assert {r.status for r in results[2].records} == {"error"}
    assert all(r.ok and r.output_tokens == 6 for r in results[3].records)


async def _stale_keepalive_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers the first request on each connection, then drops the connection at the second
    one without a byte of response: what a client sees when it reuses a connection the
    server has just decided to close."""
    served = 0
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed its side
            break
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        body = json.loads(await reader.readexactly(length))
        if served == 1:
            break
        served += 1
        events = "".join(f"data: {json.dumps({'choices': [{'text': f'w{i}'}]})}\n\n" for i in range(body["max_tokens"]))
        events += 'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     + f"content-length: {len(events)}\r\n\r\n{events}".encode())
        await writer.drain()
        if b"connection: close" in head.lower():
            break
    writer.close()


@pytest.mark.parametrize("keepalive", [False, True])
def test_stale_keepalive_connections_lose_no_request(keepalive):
    requests = build_requests(DatasetConfig(num_prompts=12, input_len=3, output_len=4), WordPrompts(), seed=0)

    async def go():
        srv = await asyncio.start_server(_stale_keepalive_server, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        target = Target(f"http://127.0.0.1:{port}", "/v1/completions", MODEL, keepalive=keepalive)
        async with srv:  # one request at a time, so a kept-alive connection is always reused
            return await run_load(target, requests, ArrivalConfig(max_concurrency=1), 0, show_progress=False)

    records = asyncio.run(go()).records
    assert [r.status for r in records] == ["ok"] * 12 and all(r.output_tokens == 4 for r in records)
    # A fresh connection per request never meets a stale one; with keep-alive every reuse
    # fails before any response byte and is retried once on a new connection.
    assert {r.attempts for r in records} == ({1, 2} if keepalive else {1})


def test_max_duration_stops_a_run_by_itself(server):
    start = time.monotonic()
    result = _run(server, 50, rate=20.0, max_duration_s=0.5, extra_body={"fake": {"delay_s": 0.1}})
    assert time.monotonic() - start < 3.0
    assert result.duration_s <= 0.5 + 1e-6 and len(result.records) < 50
    assert {r.status for r in result.records} <= {"ok", "cancelled"}
    assert any(r.status == "cancelled" for r in result.records)


def test_cli_sweep_writes_json_and_plots(server, tmp_path, capsys):
    out = tmp_path / "res.json"
    sent_before = len(server.bodies)
    rc = run(["serve", "--num-warmups", "2", "--base-url", server.base_url, "--num-prompts", "8", "--input-len", "4",
              "--output-len", "5", "--request-rates", "20,40", "--slo-ttft-ms", "500", "--slo-tpot-ms", "100",
              "--result-json", str(out), "--plot-dir", str(tmp_path / "plots"), "--seed", "3", "--no-progress",
              "--ignore-eos", "--endpoint", "/v1/chat/completions", "--api-key", "secret"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["seed"] == 3 and doc["config"]["model"] == MODEL
    assert doc["config"]["api_key"] == "<redacted>"
    assert [r["request_rate"] for r in doc["runs"]] == [20.0, 40.0]
    for r in doc["runs"]:
        assert r["summary"]["completed"] == 8 and len(r["records"]) == 8
        assert r["summary"]["slo_attainment"] == 1.0 and r["summary"]["goodput"] > 0
    assert server.bodies[-1]["ignore_eos"] is True and len(server.bodies) - sent_before == 2 + 2 * 8
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["goodput_vs_rate.png", "latency_cdf.png", "slo_attainment_vs_rate.png"]
    printed = capsys.readouterr().out
    assert "seed 3" in printed and "Rate sweep" in printed and "Goodput" in printed


def test_cli_asks_the_server_for_the_model_and_reports_user_errors(server, capsys):
    assert fetch_model_name(server.base_url) == MODEL
    assert run(["serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "1"]) == 2
    assert run(["serve", "--base-url", server.base_url, "--request-rates", "1,x"]) == 2
    assert run(["serve", "--base-url", server.base_url, "--model", "m", "--extra-body", "[1]"]) == 2
    assert capsys.readouterr().err.count("kvbaton bench: error:") == 3


def test_cli_fails_when_nothing_completes(server):
    argv = ["serve", "--base-url", server.base_url, "--num-prompts", "2", "--no-progress",
            "--extra-body", '{"fake": {"reject": true}}']
    assert run(argv) == 1
