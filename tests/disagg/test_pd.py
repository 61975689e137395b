"""Prefill/decode disaggregation end to end: real prefill and decode worker processes, real KV
transports, the tiny Llama in float32. Greedy output must equal transformers' exactly, and
every pool must be clean after each scenario (checked on exit of `router_over`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from kvbaton.router.flight import Phase
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.wait import async_wait_until

MAX_NEW = 16


@pytest.fixture(scope="module")
def redis_url():
    from kvbaton.kv.redis_server import start_redis_server

    server = start_redis_server()  # scripts/setup.sh installs redis-server: no skip
    yield server.url
    server.stop()


def transport_args(transport: str, request) -> dict:
    if transport == "redis":
        return {"redis_url": request.getfixturevalue("redis_url")}
    return {}


@pytest.mark.parametrize("transport", ["shm", "tcp", "redis", "mooncake"])
def test_1p1d_matches_transformers(tiny_llama, transport, request, tmp_path):
    """Short prompts (under one block), long ones, concurrent ones, and decode-side prefix hits."""
    extra = transport_args(transport, request) | {"log_dir": tmp_path}
    base = tiny_prompts(10, [1, 3, 4, 5, 17, 40])
    shared = tiny_prompts(11, [33])[0]
    partial = shared[:24] + tiny_prompts(12, [9])[0]  # shares 6 blocks of 4 with `shared`

    async def scenario():
        async with router_over(tiny_llama, prefill=1, decode=1, transport=transport, local_prefill_threshold=0,
                               **extra) as router:
            concurrent = await asyncio.gather(*(collect(router, f"c{i}", p, MAX_NEW) for i, p in enumerate(base)))
            first = await collect(router, "s0", shared, MAX_NEW)
            hits_before = router.stats.prefix_cache_hit_tokens
            again = await collect(router, "s1", shared, MAX_NEW)  # full hit on the decode side
            part = await collect(router, "s2", partial, MAX_NEW)  # partial hit
            hit_tokens = router.stats.prefix_cache_hit_tokens - hits_before
            return concurrent, first, again, part, dict(router.counters), hit_tokens

    concurrent, first, again, part, counters, hit_tokens = run(scenario())
    refs = hf_greedy(tiny_llama, base + [shared, partial], MAX_NEW)
    assert concurrent == refs[:6]
    assert first == again == refs[6]
    assert part == refs[7]
    assert counters["disaggregated"] == 9 and counters["fallbacks"] == 0, counters
    assert hit_tokens >= 32 + 24, "the decode worker's prefix cache should have skipped blocks"
    if transport == "shm":  # the prefill worker's pool is in shared memory: no staging copy
        assert "not in shared memory" not in (tmp_path / "kvbaton-prefill-0.log").read_text()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_2p2d_concurrent(tiny_llama, transport):
    prompts = tiny_prompts(13, [6, 14, 23, 31, 45, 52, 8, 19, 27, 36])

    async def scenario():
        async with router_over(tiny_llama, prefill=2, decode=2, transport=transport, local_prefill_threshold=0,
                               prefill_policy="round_robin", decode_policy="round_robin") as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            busy = {w["name"] for w in router.workers_view()}
            return outs, dict(router.counters), busy

    outs, counters, busy = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert counters["disaggregated"] == len(prompts) and counters["fallbacks"] == 0
    assert busy == {"kvbaton-prefill-0", "kvbaton-prefill-1", "kvbaton-decode-0", "kvbaton-decode-1"}


def test_short_prompts_prefill_on_the_decode_worker(tiny_llama):
    prompts = tiny_prompts(14, [3, 10, 40])

    async def scenario():
        async with router_over(tiny_llama, prefill=1, decode=1, local_prefill_threshold=16) as router:
            outs = [await collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)]
            return outs, dict(router.counters)

    outs, counters = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert counters["local"] == 2 and counters["disaggregated"] == 1


async def _kill_when(router, predicate, sig=signal.SIGKILL, timeout_s: float = 60.0):
    """Send `sig` to the first worker `predicate(router)` names (bounded wait)."""
    # a short polling pause: the kill must land at the moment the predicate names
    name = await async_wait_until(lambda: predicate(router), timeout_s, interval_s=0.002,
                                  message="the moment to kill never came")
    pid = router.pool.workers[name].pid
    os.kill(pid, sig)
    return name, pid


def test_decode_worker_killed_mid_stream(tiny_llama):
    prompts = tiny_prompts(15, [9, 17, 26, 33, 41, 12, 22, 38, 5, 29])
    max_new = 60

    def victim(router):
        flights = list(router.flights.values())
        if len(flights) == len(prompts) and all(len(f.tokens) >= 3 for f in flights):
            return "kvbaton-decode-1"
        return None

    async def scenario():
        async with router_over(tiny_llama, prefill=1, decode=2, local_prefill_threshold=0,
                               decode_policy="round_robin") as router:
            tasks = [asyncio.create_task(collect(router, f"r{i}", p, max_new)) for i, p in enumerate(prompts)]
            await _kill_when(router, victim)
            outs = await asyncio.gather(*tasks)
            return outs, dict(router.counters), [w["name"] for w in router.workers_view()]

    outs, counters, names = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, max_new)
    assert counters["workers_lost"] == 1 and counters["fallbacks"] >= 1
    assert "kvbaton-decode-1" not in names


def test_prefill_worker_killed_during_prefill(tiny_llama):
    prompts = tiny_prompts(16, [180, 170, 160, 150, 175, 165, 155, 145])

    def victim(router):
        for f in router.flights.values():
            if f.phase == Phase.PREFILLING and f.prefill == "kvbaton-prefill-0":
                return "kvbaton-prefill-0"
        return None

    async def scenario():
        async with router_over(tiny_llama, prefill=2, decode=1, local_prefill_threshold=0,
                               prefill_policy="round_robin") as router:
            tasks = [asyncio.create_task(collect(router, f"r{i}", p, MAX_NEW)) for i, p in enumerate(prompts)]
            await _kill_when(router, victim)
            outs = await asyncio.gather(*tasks)
            return outs, dict(router.counters)

    outs, counters = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert counters["workers_lost"] == 1


def test_stopped_receiver_is_detected_and_recovered(tiny_llama):
    """SIGSTOP a decode worker while KV flows to it: its heartbeats stop, so within
    `dead_after_s` it is declared dead, fenced (killed) and its requests finish elsewhere; the
    prefill worker's sends to it time out and free their blocks."""
    prompts = tiny_prompts(17, [120, 110, 100, 90, 115, 105])
    dead_after_s = 1.5

    def victim(router):
        for f in router.flights.values():
            if f.phase == Phase.PREFILLING and f.decode == "kvbaton-decode-0":
                return "kvbaton-decode-0"
        return None

    async def scenario():
        async with router_over(tiny_llama, prefill=1, decode=2, local_prefill_threshold=0, decode_policy="round_robin",
                               dead_after_s=dead_after_s, transfer_deadline_s=3.0) as router:
            tasks = [asyncio.create_task(collect(router, f"r{i}", p, MAX_NEW)) for i, p in enumerate(prompts)]
            _, pid = await _kill_when(router, victim, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                outs = await asyncio.gather(*tasks)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return outs, time.monotonic() - t0, dict(router.counters)

    outs, recovery_s, counters = run(scenario())
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert counters["workers_lost"] == 1
    assert recovery_s < dead_after_s + 10.0
