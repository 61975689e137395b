"""The router over colocated replicas (no prefill pool): output equals transformers' greedy
output, and a replica killed with SIGKILL mid-stream loses no request and no token."""

from __future__ import annotations

import asyncio
import os
import signal

from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run

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


def test_stop_string_ends_the_request_on_the_worker_and_leaves_nothing_behind(tiny_llama):
    """The router sees the stop string in the detokenized stream, finishes the client's request and
    aborts it on the worker; outputs the worker produced meanwhile are dropped (not processed for a
    request whose state is gone), and the router keeps serving."""
    from kvbaton.sched.sampling_params import SamplingParams
    from kvbaton.text.tokenizer import Tokenizer

    prompt = tiny_prompts(5, [9])[0]
    reference = hf_greedy(tiny_llama, [prompt], 40)[0]
    stop = Tokenizer(tiny_llama).decode(reference[3:4]).strip()  # the 4th generated word

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1) as router:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
            outs = [out async for out in router.generate("stopped", None, prompt, params)]
            after = await collect(router, "after", prompt, 8)
            return outs[-1], after, len(router.outputs._states), router.num_in_flight

    last, after, states, in_flight = run(scenario())
    completion = last.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop and stop not in completion.text
    assert len(completion.token_ids) < 40
    assert after == reference[:8] and states == 0 and in_flight == 0
