"""Elastic pools: a worker added at run time takes traffic; a drained worker finishes its
requests first, then exits; no request is dropped and every output stays exact."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.wait import async_wait_until


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
            # the drained worker exits once idle (bounded wait)
            await async_wait_until(lambda: "kvbaton-both-0" not in router.pool.workers, 30.0, interval_s=0.1,
                                   message="the drained worker did not exit")
            names = [w["name"] for w in router.workers_view()]
            with pytest.raises(ValueError, match="last"):
                await router.drain_worker(name)
            return outs, names, router.pool.launcher.is_alive("kvbaton-both-0"), old_pid

    outs, names, old_alive, _ = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, max_new)
    assert names == ["kvbaton-both-1"]
    assert not old_alive
