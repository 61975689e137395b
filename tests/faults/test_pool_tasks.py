"""The pool's own tasks never die silently: when its event loop stops (here: its socket closed
under it, a real fault, no mock), the pool goes down for good with the reason (`is_alive` false,
`dead_reason` set), the request in flight ends with an explicit EngineDeadError instead of
hanging, new requests are refused, and the workers are fenced (no process left behind)."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.router.errors import EngineDeadError
from tests.support.helpers import tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.procs import pid_alive
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.slow


def test_a_dead_event_loop_takes_the_pool_down_loudly(tiny_llama):
    prompt = tiny_prompts(41, [12])[0]

    async def scenario() -> tuple[BaseException | list[int], bool, str | None, BaseException | None, int]:
        async with router_over(tiny_llama, prefill=0, decode=1) as router:
            pid = router.pool.workers["kvbaton-both-0"].pid

            async def break_the_pool(request_id: str, n: int) -> None:
                if n >= 3 and not router.pool._events.closed:  # tokens come a decode burst at a time
                    router.pool._events.close(linger=0)  # the event loop's recv fails under it

            try:
                streamed: BaseException | list[int] = await asyncio.wait_for(
                    collect(router, "r0", prompt, 200, break_the_pool), 30)
            except EngineDeadError as exc:
                streamed = exc
            # the fence is asynchronous (bounded wait)
            await async_wait_until(lambda: not pid_alive(pid), 30.0, message=f"the fenced worker {pid} is alive")
            refused = None
            try:
                await collect(router, "r1", prompt, 4)
            except EngineDeadError as exc:
                refused = exc
            return streamed, router.is_alive, router.dead_reason, refused, pid

    streamed, alive, reason, refused, pid = run(scenario())
    assert isinstance(streamed, EngineDeadError) and "event loop" in str(streamed)
    assert not alive and reason is not None and "internal error" in reason and "event loop" in reason
    assert isinstance(refused, EngineDeadError)
    assert not pid_alive(pid)
