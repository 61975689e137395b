"""`kvbaton serve --autoscale --adapt-threshold` on a live 1P+1D deployment of the real default model: local
prefills that slow decoding make the autoscaler lower the local-prefill threshold, and prompts then go through
the prefill worker.

The deployment starts with --local-prefill-threshold 512 above the load's ~300-token prompts, so every prompt
prefills on the decode worker, in steps shared with the other streams' decoding. The TPOT SLO (1 ms) is below
anything a CPU decodes at, so TPOT is always near it and what decides is the measured interference: the
share of the decode worker's step time that its prompt chunks took (on this machine 40-70%; the bar is 15%).
Both pools are pinned to one worker (min = max = 1), so the threshold is the only thing that can move. Asserted:
the threshold is lowered to 256 within LOWER_S of the first request, logged with its reason, in /metrics and in
GET /admin/autoscaler; requests after it go through the prefill worker (the load goes on until one has, bounded
by ROUTED_S); and every request completes with all its tokens.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import Served, served, stream_completion
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS, USERS = 16, 3
LOWER_S, ROUTED_S = 30.0, 30.0
SERVE_ARGS = ("--prefill", "1", "--decode", "1", "--threads", "1", "--max-model-len", "1024", "--autoscale",
              "--slo-ttft-ms", "60000", "--slo-tpot-ms", "1", "--min-prefill", "1", "--max-prefill", "1",
              "--min-decode", "1", "--max-decode", "1", "--autoscale-interval", "1", "--autoscale-cooldown", "3",
              "--autoscale-window", "6", "--adapt-threshold", "--local-prefill-threshold", "512",
              "--min-local-prefill-threshold", "256", "--max-local-prefill-threshold", "512")
FILLER = " ".join(f"item{i % 50}" for i in range(130))  # ~300 tokens with the question


def _prompt(user: int, i: int) -> str:
    return f"Request {user}.{i}: summarize this list. {FILLER}"  # a fresh start each: no prefix-cache hits


async def _one(client: httpx.AsyncClient, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    return await stream_completion(client, body)


def _routing(base: str) -> dict:
    return httpx.get(f"{base}/admin/diagnostics/routing", timeout=10).json()


async def _load(srv: Served) -> tuple[list[dict], float, dict, dict]:
    """Users stream requests until the threshold has been lowered and a prompt has gone through the prefill
    worker since."""
    results: list[dict] = []
    stop = asyncio.Event()

    async def user(u: int, client: httpx.AsyncClient) -> None:
        for i in range(200):  # bounded: the phase ends long before
            if stop.is_set():
                return
            results.append(await _one(client, _prompt(u, i)))

    async with httpx.AsyncClient(base_url=srv.base, timeout=120) as client:
        start = time.monotonic()
        users = [asyncio.create_task(user(u, client)) for u in range(USERS)]
        try:
            async def lowered() -> bool:
                if (await asyncio.to_thread(_routing, srv.base))["local_prefill_threshold"] != 512:
                    return True
                assert not any(u.done() for u in users), [u.exception() for u in users if u.done()]
                return False

            await async_wait_until(lowered, LOWER_S, interval_s=0.25, message="the threshold was not lowered in time")
            lowered_s = time.monotonic() - start
            at_change = await asyncio.to_thread(_routing, srv.base)

            async def routed_to_prefill() -> bool:  # a prompt since the change went through the prefill worker
                now = await asyncio.to_thread(_routing, srv.base)
                return now["counters"]["disaggregated"] > at_change["counters"]["disaggregated"]

            await async_wait_until(routed_to_prefill, ROUTED_S, interval_s=0.25,
                                   message="no prompt went through the prefill worker after the change")
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*users), 120)
    return results, lowered_s, at_change, await asyncio.to_thread(_routing, srv.base)


def test_interference_lowers_the_threshold_and_prompts_move_to_the_prefill_pool(default_model_dir):
    with served(*SERVE_ARGS) as srv:
        try:
            results, lowered_s, at_change, after = asyncio.run(_load(srv))
        except BaseException:
            print(srv.log_tail(80))
            raise
        print("".join(line for line in srv.lines if "threshold" in line))
        failed = [r for r in results if r["status"] != 200 or r["errors"] or r["tokens"] != MAX_TOKENS
                  or r["finish"] != "length"]
        assert not failed, f"{len(failed)} of {len(results)} requests failed or were cut short: {failed[:3]}"

        assert at_change["local_prefill_threshold"] == 256 and at_change["counters"]["local"] >= 1
        assert after["counters"]["disaggregated"] > at_change["counters"]["disaggregated"], (at_change, after)
        assert after["local_prefill_threshold"] == 256  # 256 is the minimum: it stays

        view = httpx.get(f"{srv.base}/admin/autoscaler", timeout=10).json()
        (change,) = [s for s in view["scaling"] if s["pool"] == "local_prefill_threshold"]
        assert (change["action"], change["from"], change["to"]) == ("down", 512, 256)
        assert "local prefills took" in change["reason"] and "TPOT p99" in change["reason"], change
        share = float(change["reason"].split("local prefills took ")[1].split("%")[0]) / 100
        assert share >= view["config"]["interference_high"]
        assert view["local_prefill_threshold"]["tokens"] == 256

        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for f in text_string_to_metric_families(httpx.get(f"{srv.base}/metrics", timeout=10).text)
                   for x in f.samples}
        model = (("model_name", view_model(srv)),)
        assert samples[("kvbaton:local_prefill_threshold_tokens", model)] == 256
        assert samples[("kvbaton:autoscaler_threshold_changes_total", (("direction", "down"), *model))] == 1
        assert "lower local-prefill threshold 512->256 tokens: local prefills took" in srv.log_tail(2000)
        print(f"lowered {lowered_s:.1f} s after the first request at {share:.0%} interference; "
              f"{len(results)} requests, all complete; routing after: {after['counters']}")


def view_model(srv: Served) -> str:
    return httpx.get(f"{srv.base}/v1/models", timeout=10).json()["data"][0]["id"]
