"""A request that breaks something fails alone: a hostile request sent past the router's checks is
refused by the worker (which keeps serving), a request whose workers keep dying is tried twice and
then gets an error instead of walking through the pool, and a request that ends at its first token
in PD serving leaves nothing running on the decode worker."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvbaton.messages.router_worker import AddRequest
from kvbaton.router.errors import RequestFailedError, RequestTimeoutError
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.text.tokenizer import Tokenizer
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run


def test_hostile_request_sent_past_the_router_fails_alone(tiny_llama, tmp_path):
    """The request from the field report (a stop id past the vocabulary, banned until `min_tokens`)
    once raised IndexError inside a step and took the worker down; the worker checks it itself."""
    prompt = tiny_prompts(4, [10])[0]

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1, log_dir=tmp_path) as router:
            worker = router.pool.workers["kvbaton-both-0"]
            hostile = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[100_000_000])
            await router.pool.send(worker, AddRequest(request_id="hostile#0", prompt_token_ids=[1, 2], params=hostile))
            out = await collect(router, "after", prompt, 10)
            return out, worker.pid, router.pool.workers.get("kvbaton-both-0")

    out, pid, still_there = run(scenario())
    assert out == hf_greedy(tiny_llama, [prompt], 10)[0]
    assert still_there is not None and still_there.pid == pid
    assert "stop_token_ids must be integers in [0, 320)" in (tmp_path / "kvbaton-both-0.log").read_text()


def test_a_request_whose_workers_die_is_tried_twice_then_failed(tiny_llama):
    prompt = tiny_prompts(6, [12])[0]

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=3, dead_after_s=1.0, max_failed_attempts=2) as router:
            killed: list[str] = []
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            with pytest.raises(RequestFailedError, match="failed on 2 attempts") as info:
                async for out in router.generate("crasher", None, prompt, params):
                    flight = router.flights["crasher"]
                    # each attempt's worker dies once it has produced a few tokens of the request
                    if len(out.outputs[0].token_ids) >= 4 * (len(killed) + 1) and flight.decode not in killed:
                        killed.append(flight.decode)
                        os.kill(router.pool.workers[flight.decode].pid, signal.SIGKILL)
            after = await collect(router, "after", prompt, 8)
            return str(info.value), killed, after, len(router.outputs._states), router.num_in_flight

    message, killed, after, states, in_flight = run(scenario())
    assert len(set(killed)) == 2, killed  # two workers lost, the third never tried: no walk through the pool
    assert "died" in message
    assert after == hf_greedy(tiny_llama, [prompt], 8)[0]
    assert states == 0 and in_flight == 0


def test_stop_string_at_the_first_token_cancels_the_decode_side(tiny_llama):
    """PD: the prefill worker's first token already completes a stop string. The client's request is
    done; the decode worker must not start it (it would generate, unread, until max_tokens)."""
    prompt = tiny_prompts(7, [80])[0]
    first = hf_greedy(tiny_llama, [prompt], 1)[0]
    stop = Tokenizer(tiny_llama).decode(first)
    assert stop

    async def scenario():
        async with router_over(tiny_llama, prefill=1, decode=1) as router:
            params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True, stop=[stop])
            outs = [out async for out in router.generate("stops-at-once", None, prompt, params)]
            # NOTE: at once: the decode side's cancel went out on the same socket before this check
            reports = await router.check_workers()
            return outs[-1], reports, router.counters["disaggregated"]

    last, reports, disaggregated = run(scenario())
    assert disaggregated == 1
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].token_ids == first
    decode = reports["kvbaton-decode-0"]
    assert decode.error is None and decode.num_requests == 0, decode


def test_a_request_without_progress_is_aborted_at_its_deadline(tiny_llama):
    """A stalled worker (SIGSTOP, not yet declared dead) holds a request: after `request_timeout_s`
    without an output the client gets an error, and once the worker runs again its blocks are freed."""
    prompt = tiny_prompts(8, [10])[0]

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1, dead_after_s=60.0, request_timeout_s=1.5) as router:
            worker = router.pool.workers["kvbaton-both-0"]
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            stopped_at = None
            try:
                with pytest.raises(RequestTimeoutError, match="no progress for 2 s"):
                    async for out in router.generate("stalled", None, prompt, params):
                        if stopped_at is None and len(out.outputs[0].token_ids) >= 2:
                            os.kill(worker.pid, signal.SIGSTOP)
                            stopped_at = time.monotonic()
                waited = time.monotonic() - stopped_at
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            after = await collect(router, "after", prompt, 8)
            return waited, after, router.counters["timeouts"], router.num_in_flight

    waited, after, timeouts, in_flight = run(scenario())
    assert 1.0 < waited < 4.0 and timeouts == 1 and in_flight == 0
    assert after == hf_greedy(tiny_llama, [prompt], 8)[0]


def test_a_request_that_cannot_be_encoded_leaves_nothing_behind(tiny_llama):
    """Params changed after their checks (here a seed past int64, which msgpack cannot carry) fail at
    the send; the router's tables and the worker's load score hold nothing of the request after."""
    prompt = tiny_prompts(9, [6])[0]

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1) as router:
            params = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
            params.seed = 2**64
            with pytest.raises(OverflowError):
                async for _ in router.generate("unencodable", None, prompt, params):
                    pass
            worker = router.pool.workers["kvbaton-both-0"]
            left = (len(router.outputs._states), router.num_in_flight, set(worker.attempts))
            after = await collect(router, "after", prompt, 8)
            return left, after

    left, after = run(scenario())
    assert left == (0, 0, set())
    assert after == hf_greedy(tiny_llama, [prompt], 8)[0]


def test_an_authentic_frame_the_worker_cannot_read_fails_its_request(tiny_llama, tmp_path):
    """A value the router let through but the worker's decoder refuses (here a subnormal top_p, which
    once reached a worker as 0.0) fails that request with an error; it used to leave the client
    waiting for an answer that never came."""
    prompt = tiny_prompts(10, [6])[0]

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1, log_dir=tmp_path) as router:
            params = SamplingParams(temperature=1.0, max_tokens=4)
            params.top_p = 5e-324
            with pytest.raises(InvalidRequestError, match="could not read it"):
                async for _ in router.generate("unreadable", None, prompt, params):
                    pass
            after = await collect(router, "after", prompt, 8)
            return after, len(router.outputs._states), router.num_in_flight

    after, states, in_flight = run(scenario())
    assert after == hf_greedy(tiny_llama, [prompt], 8)[0] and states == 0 and in_flight == 0
    assert "refused a frame" in (tmp_path / "kvbaton-both-0.log").read_text()
