"""SIGKILL of the redis-server that carries PD's KV, mid-transfer: every admitted request still
completes with transformers' greedy output (a failed transfer falls back to a prefill on the
decode worker), later requests are served without the store, and the pools end clean."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvbaton.kv.redis_server import start_redis_server
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run

pytestmark = pytest.mark.slow
MAX_NEW = 16


def test_redis_killed_mid_transfer_loses_no_request(tiny_llama):
    prompts = tiny_prompts(21, [70, 90, 110, 75, 95, 120])  # all above the local-prefill threshold
    after_prompt = tiny_prompts(22, [80])[0]
    server = start_redis_server()
    try:
        async def scenario():
            async with router_over(tiny_llama, prefill=1, decode=1, transport="redis", redis_url=server.url,
                                   transfer_deadline_s=3.0) as router:
                killed_at: list[float] = []

                async def on_token(request_id: str, n: int) -> None:
                    if not killed_at:  # the first token is out: the other prompts' KV is on its way
                        os.kill(server.pid, signal.SIGKILL)
                        killed_at.append(time.monotonic())

                outs = await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW, on_token)
                                              for i, p in enumerate(prompts)))
                recovered = time.monotonic() - killed_at[0]
                after = await collect(router, "after", after_prompt, MAX_NEW)
                return outs, after, dict(router.counters), recovered

        outs, after, counters, recovered = run(scenario())
    finally:
        server.stop()
    print(f"redis SIGKILL mid-transfer: all {len(outs)} requests done {recovered:.2f} s after the kill; "
          f"counters {counters}")
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert after == hf_greedy(tiny_llama, [after_prompt], MAX_NEW)[0]
    assert counters["fallbacks"] >= 1  # some transfer did meet the dead store
