"""Elastic pools: a worker added at run time takes traffic; a drained worker finishes its
requests first, then exits; no request is dropped and every output stays exact."""

from __future__ import annotations

import asyncio

import pytest
from helpers import hf_greedy
from pd_harness import collect, router_over, run, tiny_prompts


def test_add_then_drain_under_load(tiny_llama):
    prompts = tiny_prompts(4, [7, 15, 22, 9, 31, 4, 18, 26])
    max_new = 50

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1) as router:
            started = asyncio.Event()

            async def on_token(request_id, n):
                if n >= 2:
                    started.set()

            first = [asyncio.create_task(collect(router, f"a{i}", p, max_new, on_token))
                     for i, p in enumerate(prompts[:4])]
            await started.wait()
            name = await router.add_worker("both")
            await router.wait_for_workers([name], 120)
            with pytest.raises(KeyError):
                await router.drain_worker("kvbaton-both-9")
            await router.drain_worker("kvbaton-both-0")  # still busy with the first four
            old_pid = router.pool.workers["kvbaton-both-0"].pid
            second = [asyncio.create_task(collect(router, f"b{i}", p, max_new))
                      for i, p in enumerate(prompts[4:])]
            outs = await asyncio.gather(*first, *second)
            for _ in range(100):  # the drained worker exits once idle (bounded wait)
                if "kvbaton-both-0" not in router.pool.workers:
                    break
                await asyncio.sleep(0.1)
            names = [w["name"] for w in router.workers_view()]
            with pytest.raises(ValueError, match="last"):
                await router.drain_worker(name)
            return outs, names, router.pool.launcher.is_alive("kvbaton-both-0"), old_pid

    outs, names, old_alive, _ = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, max_new)
    assert names == ["kvbaton-both-1"]
    assert not old_alive
