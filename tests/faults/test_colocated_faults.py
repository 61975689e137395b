"""Faults injected into a real colocated `kvbaton serve` (default model, one `both` worker, a
restart budget of 2): the worker SIGKILLed mid-stream, then SIGSTOPped (a stall), is replaced
each time; then, its budget spent, it stays down. Every stream ends (an error event, never a
hang), /health follows the worker (503 while none can decode, 200 once the replacement said
hello), and a replacement answers with the same greedy text as before. The tests run in file order
on one server: each fault uses up one restart of its slot."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.procs import child_pids, pid_alive
from tests.support.server import kvbaton_server
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WORKER = "kvbaton-both-0"
DEAD_AFTER_S = 2.0
MAX_RESTARTS = 2
PROMPT = "Once upon a time"
MAX_TOKENS = 16  # short: on a busy 2-core machine a decode step can take a second


@pytest.fixture(scope="module")
def server(default_model_dir) -> Iterator[tuple[str, int]]:
    with kvbaton_server("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-gb", "0.25",
                        "--max-worker-restarts", str(MAX_RESTARTS),
                        "--worker-dead-after", str(DEAD_AFTER_S)) as (base, proc):
        yield base, proc.pid


@pytest.fixture(scope="module")
def reference(server) -> str:
    """The greedy text before any fault."""
    return complete(server[0]).json()["choices"][0]["text"]


def complete(base: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def worker(base: str) -> dict:
    """The worker's slot in GET /workers ({} while a replacement is starting: it shows once it joined)."""
    return next((w for w in httpx.get(f"{base}/workers", timeout=10).json()["workers"] if w["name"] == WORKER), {})


async def stream_until_signal(base: str, pid: int, sig: signal.Signals,
                              after_chunks: int = 4) -> tuple[str, dict, float]:
    """Stream a completion, send `sig` to the worker after a few chunks; the text streamed, the
    error event that ended the stream, and the signal's time."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    text, chunks, sent_at = "", 0, 0.0
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", f"{base}/v1/completions",
                                                                       json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert line != "data: [DONE]", "the stream finished as if nothing had happened"
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return text, event, sent_at
            text += event["choices"][0]["text"]
            chunks += 1
            if chunks == after_chunks:
                os.kill(pid, sig)
                sent_at = time.monotonic()
    raise AssertionError("the stream ended without an error event")


def wait_health(base: str, status: int, timeout_s: float) -> float:
    """Poll /health until it answers `status` (bounded); the time it did (to the polling pause, 20 ms)."""
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == status, timeout_s, interval_s=0.02,
               message=f"/health did not answer {status}")
    return time.monotonic()


def fault_and_recover(base: str, server_pid: int, sig: signal.Signals, reference: str) -> dict:
    before = worker(base)
    assert before["healthy"] and before["pid"] in child_pids(server_pid)
    text, error, sent_at = asyncio.run(asyncio.wait_for(stream_until_signal(base, before["pid"], sig), 60))
    detected = wait_health(base, 503, 5)  # already 503 when the error event came
    assert reference.startswith(text) and text, "the tokens streamed before the fault were not the greedy ones"
    assert WORKER in error["error"]["message"]
    down = httpx.get(f"{base}/health", timeout=5)
    if down.status_code == 503:  # unless the replacement is up already
        assert "restarting" in down.json()["error"]["message"]
    recovered = wait_health(base, 200, 30)
    after = worker(base)
    assert complete(base).json()["choices"][0]["text"] == reference
    assert not pid_alive(before["pid"]) and after["pid"] != before["pid"] and after["healthy"]
    assert after["restarts"] == before["restarts"] + 1
    return {"old_pid": before["pid"], "error": error, "detection_s": detected - sent_at,
            "recovery_s": recovered - sent_at}


def test_sigkill_mid_stream_ends_the_stream_with_an_error_and_the_worker_is_replaced(server, reference):
    base, server_pid = server
    got = fault_and_recover(base, server_pid, signal.SIGKILL, reference)
    print(f"SIGKILL: detection <= {got['detection_s']:.2f} s, recovery {got['recovery_s']:.2f} s, "
          f"error event: {got['error']['error']['message']}")


def test_sigstop_stall_is_fenced_after_heartbeat_silence_and_replaced(server, reference):
    base, server_pid = server
    got = fault_and_recover(base, server_pid, signal.SIGSTOP, reference)
    print(f"SIGSTOP: detection <= {got['detection_s']:.2f} s, recovery {got['recovery_s']:.2f} s")
    assert DEAD_AFTER_S - 0.5 < got["detection_s"] < DEAD_AFTER_S + 1.0
    assert "no heartbeat" in got["error"]["error"]["message"]
    with pytest.raises(ProcessLookupError):  # fenced: SIGKILLed, so a SIGCONT brings nothing back
        os.kill(got["old_pid"], signal.SIGCONT)


def test_a_worker_that_keeps_dying_ends_with_its_slot_down(server, reference):
    base, _ = server
    state = worker(base)
    for _ in range(MAX_RESTARTS + 1):  # bounded: the budget is spent after at most this many deaths
        victim = state["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_health(base, 503, 5)

        def replaced_or_down(victim: int = victim) -> dict | None:
            state = worker(base)
            return state if state.get("state") == "down" or state.get("pid") not in (None, victim) else None

        state = wait_until(replaced_or_down, 30.0, interval_s=0.1, message="the worker was neither replaced nor down")
        if state.get("state") == "down":
            break
        wait_health(base, 200, 30)
    assert state["state"] == "down" and not state["healthy"] and state["restarts"] == MAX_RESTARTS
    assert "restart budget is spent" in state["reason"]
    health = httpx.get(f"{base}/health", timeout=5)
    assert health.status_code == 503 and "restart budget is spent" in health.json()["error"]["message"]
    refused = complete(base)
    assert refused.status_code in (500, 503) and "restart budget" in refused.json()["error"]["message"]
    print(f"budget spent: /health {health.status_code}: {health.json()['error']['message']}; "
          f"a new request: {refused.status_code}")
