"""`kvbaton serve --autoscale` under a load step low -> high -> low, on the real default model.

The server starts with one colocated replica (min-decode 1, max-decode 2), `--max-num-seqs 4`, a 1 s
decision interval and a 4 s cooldown. The SLOs are far above what this machine measures (the test checks
that the low phase's TPOT is under a quarter of the TPOT SLO), so the step drives the pool through queue
depth and the feasible batch (capped by max_num_seqs): 8 concurrent streams need ceil(8 / 4) = 2 replicas,
2 streams need 1.

Stated times, asserted as generous deadlines: the pool has grown to 2 replicas (the new one joined and took
requests) within GROW_S = 180 s of the high phase's start, and is back to 1 (the drained replica finished its
requests and exited) within SHRINK_S = 45 s of the low phase's start. Measured on this 2-core machine shared
with other jobs: the scale-up is decided ~1.3 s into the high phase and the new replica joins after ~30-38 s
(its start-up, competing for the cores with the busy replica, the server and this test); the pool is back to 1
~3-8 s into the low phase (the cooldown's rest, one interval, the drain). Every request of every phase
completes with all its tokens; /metrics and GET /admin/autoscaler show the decisions with their reasons.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import Served, served, stream_completion
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
SLO_TTFT_MS, SLO_TPOT_MS = 20_000, 2_000
LOW_USERS, LOW_S, HIGH_USERS, HOLD_S = 2, 4.0, 8, 3.0
GROW_S, SHRINK_S = 180.0, 45.0  # ~5x the measured join (a busy CI host starts workers slower), ~6x the shrink
SERVE_ARGS = ("--threads", "1", "--max-model-len", "512", "--max-num-seqs", "4", "--autoscale",
              "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS), "--min-decode", "1",
              "--max-decode", "2", "--autoscale-interval", "1", "--autoscale-cooldown", "4", "--autoscale-window", "6")


class Load:
    """Users that each stream one request after another until told to stop; each request's outcome is kept."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.results: list[dict] = []
        self.users: list[tuple[asyncio.Event, asyncio.Task]] = []

    def add_users(self, n: int) -> None:
        for _ in range(n):
            stop = asyncio.Event()
            self.users.append((stop, asyncio.create_task(self._user(len(self.users), stop))))

    async def stop_users(self, keep: int = 0) -> None:
        """Stop all but the first `keep` users; each finishes the request it is in (bounded wait)."""
        leaving = self.users[keep:]
        del self.users[keep:]
        for stop, _ in leaving:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in leaving)), 120)

    async def _user(self, user: int, stop: asyncio.Event) -> None:
        for i in range(1000):  # bounded: a phase ends long before
            if stop.is_set():
                return
            self.results.append(await self._one(f"User {user} asks question {i}: tell me about the sea."))

    async def _one(self, prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        start = time.monotonic()
        result = await stream_completion(self.client, body)
        times = result.get("times", [])
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return {**result, "start": start, "tpot": tpot}


def _joined(base: str) -> list[dict]:
    return [w for w in httpx.get(f"{base}/workers", timeout=10).json()["workers"] if w.get("healthy")]


async def _seconds_until(what: str, check, timeout_s: float) -> float:
    """Seconds until `check()` (a blocking call: run on a thread) held, polled every 0.25 s; fail after
    `timeout_s`."""
    start = time.monotonic()
    await async_wait_until(lambda: asyncio.to_thread(check), timeout_s, interval_s=0.25,
                           message=f"{what} did not happen")
    return time.monotonic() - start


def test_load_step_grows_and_shrinks_the_decode_pool(default_model_dir):
    with served(*SERVE_ARGS) as srv:
        try:
            grow_s, shrink_s, results, took_traffic, high_start = asyncio.run(_load_step(srv))
        except BaseException:
            print(srv.log_tail(80))
            raise
        print("".join(line for line in srv.lines if "autoscale" in line or "joined" in line or "drained" in line))
        _check_results(results)
        assert took_traffic, "the added replica never ran a request"
        decided_s = _check_observability(srv, high_start)
        print(f"scale-up decided {decided_s:.1f} s into the high phase, joined after {grow_s:.1f} s; "
              f"shrank {shrink_s:.1f} s into the low phase; {len(results)} requests, all complete")


async def _load_step(srv: Served) -> tuple[float, float, list[dict], bool, float]:
    base = srv.base
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        load = Load(client)
        try:
            load.add_users(LOW_USERS)  # low
            deadline = time.monotonic() + LOW_S
            while time.monotonic() < deadline:
                assert len(await asyncio.to_thread(_joined, base)) == 1, "the pool grew under the low load"
                # pacing the load step's low phase, watched for a growth that must not come: the phase is the test
                await asyncio.sleep(0.5)  # noqa: TID251 - pacing a load phase (and a window for what must not happen)
            low_tpots = [r["tpot"] for r in load.results if r.get("tpot")]
            assert low_tpots and statistics.median(low_tpots) * 1000 < SLO_TPOT_MS / 4, low_tpots

            high_start = time.time()
            load.add_users(HIGH_USERS - LOW_USERS)  # high
            grow_s = await _seconds_until("scale-up", lambda: len(_joined(base)) == 2, GROW_S)
            hold_end = time.monotonic() + HOLD_S

            def new_replica_busy() -> bool:
                return any(w["name"] != "kvbaton-both-0" and w["in_flight"] > 0 for w in _joined(base))

            # bounded: the new replica is the least loaded, so it takes a request soon
            await _seconds_until("the added replica taking a request", new_replica_busy, HOLD_S + 30)
            took_traffic = True
            # the high phase lasts HOLD_S at least: pacing the load step is the behaviour under test
            await asyncio.sleep(max(0.0, hold_end - time.monotonic()))  # noqa: TID251 - pacing a load phase

            low_start = time.monotonic()  # low again
            await load.stop_users(keep=LOW_USERS)
            drained_busy: set[str] = set()  # a draining replica seen with requests still in flight

            def shrunk() -> bool:
                workers = _joined(base)
                drained_busy.update(w["name"] for w in workers if w["draining"] and w["in_flight"] > 0)
                return len(workers) == 1

            await _seconds_until("scale-down", shrunk, SHRINK_S)
            shrink_s = time.monotonic() - low_start
            assert shrink_s < SHRINK_S, f"scale-down took {shrink_s:.0f} s"
            print(f"drained with requests in flight: {sorted(drained_busy) or 'none seen'}")
            shrunk_at = time.monotonic()
            # the low users go on past the drain's end: a request begun after it has completed
            await async_wait_until(lambda: any(r["start"] >= shrunk_at for r in load.results), 60.0, interval_s=0.25,
                                   message="no request completed after the drain's end")
        finally:
            await load.stop_users()
    return grow_s, shrink_s, load.results, took_traffic, high_start


def _check_results(results: list[dict]) -> None:
    failed = [r for r in results if r["status"] != 200 or r["errors"] or r["tokens"] != MAX_TOKENS
              or r["finish"] != "length"]
    assert not failed, f"{len(failed)} of {len(results)} requests failed or were cut short: {failed[:3]}"
    assert len(results) >= HIGH_USERS


def _check_observability(srv: Served, high_start: float) -> float:
    """The decisions in /metrics, GET /admin/autoscaler and the log; returns the seconds from the high phase's
    start to the scale-up decision."""
    samples = [x for f in text_string_to_metric_families(httpx.get(f"{srv.base}/metrics", timeout=10).text)
               if f.name.startswith("kvbaton:autoscaler") for x in f.samples]
    decisions = {(x.labels["pool"], x.labels["action"]): x.value for x in samples
                 if x.name == "kvbaton:autoscaler_decisions_total"}
    assert decisions.get(("decode", "up"), 0) >= 1 and decisions.get(("decode", "down"), 0) >= 1, decisions
    last = [x.labels for x in samples if x.name == "kvbaton:autoscaler_last_scaling"]
    assert len(last) == 1 and last[0]["action"] == "down" and "demand" in last[0]["reason"], last
    assert [x.value for x in samples if x.name == "kvbaton:autoscaler_target_workers"] == [1.0]

    view = httpx.get(f"{srv.base}/admin/autoscaler", timeout=10).json()
    scaling = [(s["action"], s["from"], s["to"], s["result"]) for s in view["scaling"]]
    assert ("up", 1, 2, "joined") in scaling and ("down", 2, 1, "draining") in scaling, scaling
    assert all("demand" in s["reason"] for s in view["scaling"]), view["scaling"]
    assert view["pools"]["decode"]["workers"] == 1 and view["measurements"]["max_batch"] == 4
    log = srv.log_tail(2000)
    assert "up decode 1->2" in log and "down decode 2->1" in log, "the decisions were not logged"
    return next(s["at"] for s in view["scaling"] if s["action"] == "up") - high_start
