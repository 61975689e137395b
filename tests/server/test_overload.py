"""Above capacity the server refuses fast (503 + Retry-After), finishes what it admitted,
and its KV cache returns to empty."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.server import kvbaton_server
from tests.support.wait import async_wait_until, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


async def _fire(base: str, n: int) -> list[tuple[int, float, dict, dict]]:
    body = {"model": MODEL, "prompt": "Tell me a story about a dragon.", "max_tokens": 16, "ignore_eos": True}

    async def one(client: httpx.AsyncClient):
        start = time.monotonic()
        r = await client.post(f"{base}/v1/completions", json=body)
        return r.status_code, time.monotonic() - start, dict(r.headers), r.json()

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client) for _ in range(n)))


def test_overload_gets_fast_503_and_admitted_requests_finish(default_model_dir):
    with kvbaton_server("--dtype", "float32", "--max-waiting-requests", "2", "--max-num-seqs", "2") as (base, _):
        results = asyncio.run(_fire(base, 16))
        ok = [r for r in results if r[0] == 200]
        busy = [r for r in results if r[0] == 503]
        assert len(ok) + len(busy) == len(results), [r[0] for r in results]
        assert ok and busy
        for _, seconds, headers, body in busy:
            assert headers.get("retry-after") == "1"
            assert "server busy" in body["error"]["message"] and body["error"]["code"] == 503
            assert seconds < 5.0
        assert all(body["usage"]["completion_tokens"] == 16 for _, _, _, body in ok)
        def drained() -> dict | None:
            stats = httpx.get(f"{base}/stats").json()
            return stats if stats["kv_cache_usage"] == 0.0 and stats["num_in_flight"] == 0 else None

        stats = wait_until(drained, 30.0, interval_s=0.2, message="the KV cache did not empty")
        assert stats["kv_cache_usage"] == 0.0 and stats["num_pending_admission"] == 0, stats
        metrics = httpx.get(f"{base}/metrics").text
        assert f'kvbaton:request_rejected_total{{model_name="{MODEL}"}} {float(len(busy))}' in metrics


def test_engine_core_death_is_reported_not_hung(default_model_dir):
    from tests.support.procs import child_pids

    with kvbaton_server("--dtype", "float32") as (base, proc):
        core_pid = child_pids(proc.pid)[0]
        import os
        import signal

        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                task = asyncio.create_task(client.post(f"{base}/v1/completions", json=body))

                async def running() -> bool:  # the engine core is at work on it (/stats: its last heartbeat)
                    return (await client.get(f"{base}/stats")).json()["num_running"] >= 1

                await async_wait_until(running, 60.0, interval_s=0.1, message="the request never ran")
                os.kill(core_pid, signal.SIGKILL)
                return await task

        r = asyncio.run(run())
        assert r.status_code == 503 and "engine core exited" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 503
