"""Expert-parallel groups served behind the router (real processes, tiny Qwen3-MoE, fp32): a colocated EP2
group and a 1P(EP2) + 1D(EP1) deployment, with EPLB re-placing experts every few steps, give transformers'
greedy output; a rank SIGKILLed mid-stream
takes its group down (detected, its mate fenced), its requests finish on the other group, and the group
restarts as a whole."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvbaton.router.flight import Phase
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.procs import listening_addresses
from tests.support.wait import async_wait_until

MAX_NEW = 16


@pytest.fixture(scope="module")
def moe_model(tiny_moe_models):
    return tiny_moe_models["qwen3_moe"]


@pytest.fixture(scope="module")
def references(moe_model):
    prompts = tiny_prompts(41, [3, 30, 12, 45, 7, 20])
    return prompts, hf_greedy(moe_model, prompts, MAX_NEW)


@pytest.mark.parametrize("prefill", [0, 1], ids=["colocated", "pd"])
def test_served_expert_parallel_group_matches_transformers(moe_model, references, prefill):
    prompts, refs = references

    async def scenario():
        # NOTE: pd: a prefill group of 2 ranks hands its KV to a decode group of another size (1), with EPLB on
        async with router_over(moe_model, prefill=prefill, decode=1, decode_ep_size=1 if prefill else 2,
                               prefill_ep_size=2, num_redundant_experts=2, eplb_interval_steps=3,
                               local_prefill_threshold=0) as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            view = router.workers_view()
            listening = {name: listening_addresses(w.pid) for name, w in router.pool.workers.items()}
            return outs, view, listening

    outs, view, listening = run(scenario())
    assert outs == refs
    # every socket a rank listens on (the group's rendezvous store, gloo's pairs, the KV and control sockets) is on
    # loopback: torch's store would listen on every interface, gloo where the hostname resolves
    assert all(address == "127.0.0.1" for ports in listening.values() for address in ports.values()), listening
    group_rank0 = "kvbaton-prefill-0" if prefill else "kvbaton-both-0"
    assert len(listening[group_rank0]) >= 2, listening  # the store and a gloo pair listener at least
    groups = {w["name"]: w["ep_group"] for w in view}
    expected = {"kvbaton-both-0": "kvbaton-both-ep0", "kvbaton-both-1": "kvbaton-both-ep0"} if not prefill else {
        "kvbaton-prefill-0": "kvbaton-prefill-ep0", "kvbaton-prefill-1": "kvbaton-prefill-ep0",
        "kvbaton-decode-0": None}
    assert groups == expected


@pytest.mark.slow
def test_rank_killed_mid_stream_tears_its_group_down_and_loses_nothing(moe_model, references):
    prompts, refs = references

    async def scenario():
        async with router_over(moe_model, prefill=0, decode=2, decode_ep_size=2, decode_policy="round_robin",
                               dead_after_s=2.0, max_failed_attempts=3) as router:
            tasks = [asyncio.create_task(collect(router, f"r{i}", p, MAX_NEW)) for i, p in enumerate(prompts)]
            victim = "kvbaton-both-1"  # rank 1 of group 0; its mate is kvbaton-both-0
            await async_wait_until(
                lambda: any(victim in (f.prefill, f.decode) and f.phase == Phase.DECODING and len(f.tokens) >= 2
                            for f in router.flights.values()),
                60.0, interval_s=0.002, message="no request decoding on the victim")  # kill it mid-stream
            os.kill(router.pool.workers[victim].pid, signal.SIGKILL)
            killed = time.monotonic()
            await async_wait_until(lambda: "kvbaton-both-0" not in router.pool.workers
                                   and victim not in router.pool.workers,
                                   15.0, interval_s=0.005, message="the group was not torn down")
            torn_down = time.monotonic() - killed
            outs = await asyncio.gather(*tasks)
            await async_wait_until(lambda: all(n in router.pool.workers for n in ("kvbaton-both-0", victim)),
                                   120.0, interval_s=0.05, message="the group did not come back")
            back = time.monotonic() - killed
            again = await asyncio.gather(*(collect(router, f"again{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            return outs, again, torn_down, back, router.workers_view()

    outs, again, torn_down, back, view = run(scenario())
    print(f"group torn down {torn_down:.2f} s after the kill, back after {back:.2f} s")
    assert outs == refs and again == refs
    restarts = {w["name"]: w["restarts"] for w in view}
    assert restarts == {"kvbaton-both-0": 1, "kvbaton-both-1": 1, "kvbaton-both-2": 0, "kvbaton-both-3": 0}
