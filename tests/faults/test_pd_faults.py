"""PD faults on real worker processes (1 prefill + 2 decode, tiny model): the prefill worker
SIGKILLed mid-transfer and a decode worker SIGKILLed mid-stream lose no admitted request (each
completes with transformers' greedy text, or ends with an explicit error), both are replaced
under their names, and every live worker's KV pool passes its integrity check afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvbaton.router.errors import EngineError
from kvbaton.router.flight import Phase
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import assert_pools_clean, collect, kill_when, router_over, run
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.slow

MAX_NEW = 64  # prompt + output stay within the tiny model's 256 positions


async def time_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """When `predicate` came true (bounded wait)."""
    await async_wait_until(predicate, timeout_s, interval_s=0.005, message="timed out")
    return time.monotonic()


def test_prefill_killed_mid_transfer_and_decode_killed_mid_stream_lose_nothing(tiny_llama):
    prompts = tiny_prompts(31, [170, 160, 150, 165, 155, 145])
    refs = hf_greedy(tiny_llama, prompts + prompts[:1], MAX_NEW)

    async def scenario() -> tuple[list, list[int], dict[str, float], list]:
        async with router_over(tiny_llama, prefill=1, decode=2, local_prefill_threshold=0,
                               decode_policy="round_robin", dead_after_s=2.0, max_failed_attempts=3) as router:
            tasks = [asyncio.create_task(collect(router, f"r{i}", p, MAX_NEW)) for i, p in enumerate(prompts)]
            times: dict[str, float] = {}
            for name, phase, min_tokens in (("kvbaton-prefill-0", Phase.PREFILLING, 0),
                                            ("kvbaton-decode-1", Phase.DECODING, 3)):
                killed = await kill_when(router, name, phase, min_tokens)
                gone = await time_until(lambda n=name: n not in router.pool.workers, 10)
                times[f"{name} detection"] = gone - killed
                times[f"{name} killed at"] = killed
            outs = await asyncio.gather(*tasks, return_exceptions=True)
            for name in ("kvbaton-prefill-0", "kvbaton-decode-1"):
                back = await time_until(lambda n=name: n in router.pool.workers, 60)
                times[f"{name} recovery"] = back - times.pop(f"{name} killed at")
            await assert_pools_clean(router)  # every live worker, the replacements included
            again = await collect(router, "again", prompts[0], MAX_NEW)  # through the replaced prefill worker
            return outs, again, times, router.workers_view()

    outs, again, times, view = run(scenario())
    for name, seconds in times.items():
        print(f"{name}: {seconds:.2f} s")
    errors = [o for o in outs if isinstance(o, BaseException)]
    assert all(isinstance(e, EngineError) for e in errors), errors  # an explicit error, never a hang
    lost = [i for i, o in enumerate(outs) if not isinstance(o, BaseException) and o != refs[i]]
    print(f"requests: {len(outs)}, completed correctly: {len(outs) - len(errors) - len(lost)}, "
          f"explicit errors: {len(errors)}, wrong or lost: {len(lost)}")
    assert not lost and not errors  # a decode worker was always left: every request completes
    assert again == refs[-1]
    assert {w["name"]: w["restarts"] for w in view} == {"kvbaton-prefill-0": 1, "kvbaton-decode-0": 0,
                                                         "kvbaton-decode-1": 1}
    assert all(w["healthy"] for w in view)
