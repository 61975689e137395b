"""The router over colocated replicas (no prefill pool): output equals transformers' greedy
output, and a replica killed with SIGKILL mid-stream loses no request and no token."""

from __future__ import annotations

import asyncio
import os
import signal

from helpers import hf_greedy
from pd_harness import collect, router_over, run, tiny_prompts

MAX_NEW = 24


def test_two_replicas_match_transformers(tiny_llama):
    prompts = tiny_prompts(1, [1, 3, 9, 17, 30, 41])

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=2, decode_policy="round_robin") as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            used = {w["name"] for w in router.workers_view() if w["role"] == "both"}
            return outs, used

    outs, used = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert used == {"kvbaton-both-0", "kvbaton-both-1"}


def test_replica_killed_mid_stream_loses_nothing(tiny_llama):
    prompts = tiny_prompts(2, [5, 8, 13, 21, 34, 6, 11, 27, 19, 3])
    max_new = 60

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=2, decode_policy="round_robin",
                               dead_after_s=1.0) as router:
            victim = router.pool.workers["kvbaton-both-1"]
            killed = asyncio.Event()

            async def on_token(request_id: str, n: int) -> None:
                # Kill once every stream is under way, while all are mid-generation.
                if n >= 4 and not killed.is_set() and all(
                        f.tokens for f in router.flights.values()) and len(router.flights) == len(prompts):
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.set()

            outs = await asyncio.gather(*(collect(router, f"r{i}", p, max_new, on_token)
                                          for i, p in enumerate(prompts)))
            alive = [w["name"] for w in router.workers_view()]
            return outs, killed.is_set(), alive

    outs, killed, alive = run(scenario())
    assert killed
    assert alive == ["kvbaton-both-0"]
    assert outs == hf_greedy(tiny_llama, prompts, max_new)
