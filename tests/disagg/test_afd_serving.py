"""Attention/FFN disaggregation served behind the router (real processes, tiny Qwen3-MoE, fp32): expert workers
hold the routed experts, the decode (colocated) workers are attention workers dispatching to them, and the
output is transformers' greedy output, for 2 attention workers over 1 expert worker (m = 2) and for a PD
prefill worker in front of 1 attention worker over 2 expert workers (m = 3, --encrypt-traffic: the exchange
sockets CURVE too; 2 redundant slots and EPLB every 2 busy steps: experts move mid-stream). `/workers` shows both
roles and which experts each expert worker owns; every socket listens on loopback; every pool passes its
integrity check."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from prometheus_client import generate_latest

from kvbaton.router.errors import EngineDeadError
from kvbaton.router.supervision import RestartPolicy
from kvbaton.server.metrics import ServerMetrics
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.procs import listening_addresses
from tests.support.wait import async_wait_until

MAX_NEW = 12
NUM_EXPERTS = 8  # the tiny MoE checkpoints'


@pytest.fixture(scope="module")
def moe_model(tiny_moe_models):
    return tiny_moe_models["qwen3_moe"]


@pytest.fixture(scope="module")
def references(moe_model):
    prompts = tiny_prompts(43, [3, 30, 12, 45, 7, 20])
    return prompts, hf_greedy(moe_model, prompts, MAX_NEW)


@pytest.mark.parametrize(("prefill", "attention", "experts", "micro_batches", "encrypt", "eplb"),
                         [(0, 2, 1, 2, False, False), (1, 1, 2, 3, True, True)],
                         ids=["2:1-m2", "pd-1:2-m3-encrypted-eplb"])
def test_served_afd_matches_transformers(moe_model, references, prefill, attention, experts, micro_batches, encrypt,
                                         eplb):
    prompts, refs = references
    balance = {"num_redundant_experts": 2, "eplb_interval_steps": 2} if eplb else {}

    async def scenario():
        async with router_over(moe_model, prefill=prefill, decode=attention, expert_workers=experts,
                               afd_micro_batches=micro_batches, local_prefill_threshold=0,
                               encrypt_traffic=encrypt, **balance) as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            # every expert worker computed rows for the attention workers (its heartbeat carries the count), and,
            # with EPLB, they hold the same newer placement by now (the last one handed out loads in the background)
            def settled() -> bool:
                pool = [w["experts"] for w in router.workers_view() if w["role"] == "expert"]
                epochs = {e.get("placement_epoch", -1) for e in pool}
                return all(e.get("rows", 0) > 0 for e in pool) and len(epochs) == 1 and min(epochs) >= eplb

            await async_wait_until(settled, 10.0, interval_s=0.05,
                                   message=lambda: f"no exchanges: {router.workers_view()}")
            listening = {name: listening_addresses(w.pid) for name, w in router.pool.workers.items()}
            # the bubble, both sides, as /metrics shows it (the attention workers' loads come with their outputs)
            await async_wait_until(lambda: router.stats.afd is not None and router.stats.afd.expert_busy_s > 0, 10.0,
                                   interval_s=0.05, message=lambda: f"no AFD stats: {router.stats.afd}")
            metrics = ServerMetrics("m")
            metrics.observe_stats(router.stats)
            return outs, router.workers_view(), listening, router.stats.afd, generate_latest(metrics.registry).decode()

    outs, view, listening, afd, exposition = run(scenario())
    assert outs == refs
    assert all(address == "127.0.0.1" for ports in listening.values() for address in ports.values()), listening
    roles = sorted(w["role"] for w in view)
    attention_role = "decode" if prefill else "both"
    assert roles == sorted(["prefill"] * prefill + [attention_role] * attention + ["expert"] * experts)
    owned = {w["name"]: w["experts"]["owns"] for w in view if w["role"] == "expert"}
    per_worker = NUM_EXPERTS // experts
    if not eplb:
        assert owned == {f"kvbaton-expert-{r}": list(range(r * per_worker, (r + 1) * per_worker))
                         for r in range(experts)}
    else:  # every layer's placement, over the pool, still holds every expert (and 2 copies)
        by_layer = [w["experts"]["owns_by_layer"] for w in view if w["role"] == "expert"]
        for layer in by_layer[0]:
            slots = [e for owns in by_layer for e in owns[layer]]
            assert len(slots) == NUM_EXPERTS + 2 and set(slots) == set(range(NUM_EXPERTS)), (layer, slots)
    exchanges = [w["experts"]["exchange"] for w in view if w["role"] == "expert"]
    for w in view:
        if w["role"] == "expert":  # its exchange socket listens where its hello says, on loopback
            assert w["experts"]["exchange"].rsplit(":", 1)[1] in listening[w["name"]]
    assert len(set(exchanges)) == experts
    for w in view:
        if w["role"] == "expert":
            assert w["experts"]["refused_frames"] == 0 and 0.0 <= w["experts"]["idle_fraction"] <= 1.0
            assert w["experts"]["bytes_in"] > 0 and w["experts"]["bytes_out"] > 0
            # one host: every exchange's rows went through shared memory
            assert w["experts"]["shared_exchanges"] == w["experts"]["exchanges"] > 0
    # every MoE layer of every step's micro-batches exchanged with the pool: 3 MoE layers, at least MAX_NEW steps
    assert afd.exchanges >= 3 * MAX_NEW and afd.bytes_sent > 0 and afd.bytes_received > 0
    assert 0 < afd.attention_wait_s < afd.attention_step_s and 0 < afd.expert_busy_s < afd.expert_alive_s
    assert 0 < afd.attention_bubble < 1 and 0 < afd.expert_bubble < 1
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
              if line.startswith("kvbaton:afd_")}
    assert gauges["kvbaton:afd_attention_bubble_ratio"] == pytest.approx(afd.attention_bubble)
    assert gauges["kvbaton:afd_expert_bubble_ratio"] == pytest.approx(afd.expert_bubble)


async def _kill_mid_stream(router, prompts, victim: str, tag: str):
    """Stream every prompt, SIGKILL `victim` once a request has decoded 2 tokens, and return the streams' tokens
    and how long after the kill the last one finished."""
    tasks = [asyncio.create_task(collect(router, f"{tag}{i}", p, MAX_NEW)) for i, p in enumerate(prompts)]
    await async_wait_until(lambda: any(len(f.tokens) >= 2 for f in router.flights.values()),
                           60.0, interval_s=0.002, message="no request decoding")
    os.kill(router.pool.workers[victim].pid, signal.SIGKILL)
    killed = time.monotonic()
    outs = await asyncio.gather(*tasks)
    return outs, time.monotonic() - killed


@pytest.mark.parametrize(("attention", "experts", "micro_batches", "eplb"), [(1, 1, 2, False), (2, 2, 0, True)],
                         ids=["1:1-m2", "2:2-auto-eplb"])
def test_workers_killed_mid_stream_lose_nothing(moe_model, references, attention, experts, micro_batches, eplb):
    """SIGKILL an expert worker while every stream decodes (the only one in 1:1): the attention workers' exchanges
    in flight on it fail at once (the connection dropped), those requests continue from their streamed tokens,
    the pool starts a replacement on the same port, and every stream completes with transformers' tokens, none
    lost or repeated. In 2:2, an attention worker is SIGKILLed next: its requests continue on the other one; and
    EPLB moves experts every 2 busy steps: the replacement expert worker is handed the placement in use."""
    prompts, refs = references
    victim = f"kvbaton-expert-{experts - 1}"
    balance = {"num_redundant_experts": 2, "eplb_interval_steps": 2} if eplb else {}

    async def scenario():
        async with router_over(moe_model, prefill=0, decode=attention, expert_workers=experts,
                               afd_micro_batches=micro_batches, max_failed_attempts=3,
                               decode_policy="round_robin", **balance) as router:
            results = [await _kill_mid_stream(router, prompts, victim, "e")]
            await async_wait_until(lambda: victim in router.pool.workers, 60.0, interval_s=0.05,
                                   message="the expert worker was not replaced")
            if attention > 1:
                results.append(await _kill_mid_stream(router, prompts, "kvbaton-both-1", "a"))
            again = await asyncio.gather(*(collect(router, f"again{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            if eplb:  # the replacement holds a placement EPLB made, not only the first one (its heartbeat says)
                await async_wait_until(lambda: any(w["name"] == victim and w["experts"].get("placement_epoch", 0) > 0
                                                   for w in router.workers_view()),
                                       10.0, interval_s=0.05, message=lambda: f"{router.workers_view()}")
            return results, again, router.workers_view()

    results, again, view = run(scenario())
    print("every stream done " + ", ".join(f"{done:.2f} s" for _, done in results) + " after each kill")
    assert all(outs == refs for outs, _ in results) and again == refs
    restarts = {w["name"]: w["restarts"] for w in view}
    assert restarts[victim] == 1 and all(n == 0 for name, n in restarts.items()
                                         if name not in (victim, "kvbaton-both-1"))


def test_an_expert_worker_down_for_good_has_its_experts_placed_on_the_others(moe_model, references):
    """1:4 with 4 redundant slots (one copy per worker), EPLB on, no restarts: SIGKILL an expert worker
    mid-stream. The exchanges it held fail and those requests continue from their streamed tokens; some of its
    experts have no copy, so attention worker 0 places every expert over the 3 workers up, which load them while
    the step waits; the pool is never down, and every stream and every new request completes with transformers'
    tokens. (Routing to copies placed ahead of time: `tests/parallel/test_afd.py`.)"""
    prompts, refs = references
    victim = "kvbaton-expert-1"

    async def scenario():
        async with router_over(moe_model, prefill=0, decode=1, expert_workers=4, num_redundant_experts=4,
                               eplb_interval_steps=1000,  # EPLB on, no plan of its own within this test
                               afd_micro_batches=2, max_failed_attempts=3,
                               restart=RestartPolicy(max_restarts=0)) as router:
            outs, _ = await _kill_mid_stream(router, prompts, victim, "e")
            await async_wait_until(lambda: victim not in router.pool.workers, 30.0, interval_s=0.05,
                                   message="the expert worker is still in the pool")
            again = await asyncio.gather(*(collect(router, f"again{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            # the survivors' heartbeats carry the placement they switched to
            await async_wait_until(lambda: all(w["experts"].get("placement_epoch", 0) >= 1
                                               for w in router.workers_view()
                                               if w["role"] == "expert" and w["name"] != victim),
                                   10.0, interval_s=0.05, message=lambda: f"{router.workers_view()}")
            return outs, again, router.pool.down_reason, router.workers_view()

    outs, again, reason, view = run(scenario())
    survivors = [w["experts"] for w in view if w["role"] == "expert" and w["name"] != victim]
    assert len(survivors) == 3
    for layer in survivors[0]["owns_by_layer"]:  # every expert among them, in every layer
        assert {x for e in survivors for x in e["owns_by_layer"][layer]} == set(range(NUM_EXPERTS))
    assert outs == refs and again == refs
    assert reason is None


def test_an_expert_worker_down_for_good_takes_the_pool_down_with_the_reason(moe_model):
    """With no restart left, a dead expert worker leaves its experts nowhere: the pool says so (/health's 503
    reason) and a new request fails at once with it, rather than waiting on exchanges that cannot happen."""
    prompt = tiny_prompts(5, [6])[0]

    async def scenario():
        async with router_over(moe_model, prefill=0, decode=1, expert_workers=1,
                               restart=RestartPolicy(max_restarts=0)) as router:
            os.kill(router.pool.workers["kvbaton-expert-0"].pid, signal.SIGKILL)
            await async_wait_until(lambda: not router.is_alive, 30.0, interval_s=0.05,
                                   message="the pool did not go down")
            with pytest.raises(EngineDeadError) as refused:
                await collect(router, "after", prompt, MAX_NEW)
            return router.pool.down_reason, str(refused.value)

    reason, refused = run(scenario())
    assert "kvbaton-expert-0 is down for good" in reason and "MoE layers" in reason
    assert refused == reason
