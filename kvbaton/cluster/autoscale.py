"""The SLA autoscaler: a task in the server process that resizes the worker pools from measured TTFT,
TPOT, queue depth and KV usage (`kvbaton serve --autoscale`).

Every `sample_s` it samples the pool (each worker's running, waiting and receiving requests and its KV
usage, as last reported by heartbeats and outputs) and the router's requests (arrivals, prompts through
their prefill); the server hands it every finished request (TTFT, TPOT). Every `interval_s` it turns that
window into `Measurements`, asks `autoscale_policy` for a decision per pool, and acts through the
router's `add_worker` / `drain_worker`, the calls behind `POST /admin/workers`: the same on every
launcher (local processes, Ray actors). A drained worker finishes its requests before it exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvbaton.cluster.autoscale_policy import (
    Action,
    AutoscaleConfig,
    Decision,
    Measurements,
    Pool,
    PoolState,
    decide,
    decode_verdict,
    encode_verdict,
    prefill_verdict,
)
from kvbaton.cluster.autoscale_threshold import ThresholdDecision, threshold_decision
from kvbaton.cluster.autoscale_window import FlightWatch, LoadWindow, PoolSample
from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.router.router import Router
from kvbaton.router.supervision import SlotState
from kvbaton.text.request_output import RequestOutput

logger = logging.getLogger(__name__)
DecisionListener = Callable[[Decision, Measurements], None]

_ROLES = {Pool.PREFILL: (WorkerRole.PREFILL,), Pool.DECODE: (WorkerRole.DECODE, WorkerRole.BOTH),
          Pool.ENCODE: (WorkerRole.ENCODE,)}
# the router makes a decode worker `both` alone
_ADD_ROLE = {Pool.PREFILL: WorkerRole.PREFILL, Pool.DECODE: WorkerRole.DECODE, Pool.ENCODE: WorkerRole.ENCODE}
_VERDICTS = {Pool.PREFILL: prefill_verdict, Pool.DECODE: decode_verdict, Pool.ENCODE: encode_verdict}


class Autoscaler:
    def __init__(self, router: Router, config: AutoscaleConfig, max_workers: int, sample_s: float = 0.25) -> None:
        self.router, self.config, self.max_workers = router, config, max_workers
        self.sample_s = min(sample_s, config.interval_s / 4)
        roles = {s.spec.role for s in router.pool.supervisor.slots.values()}
        # NOTE: a pool the deployment started without stays without (0 prefill: colocated; 0 encode: --encode 0)
        self.pools = (Pool.DECODE, *(p for p in (Pool.PREFILL, Pool.ENCODE) if _ROLES[p][0] in roles))
        self.window = LoadWindow(config.window_s)
        threshold = router.config.local_prefill_threshold if Pool.PREFILL in self.pools else 0
        self._flights = FlightWatch(prefill_threshold=threshold)
        self.max_batch = router.pool.engine_config.scheduler.max_num_seqs
        self.listeners: list[DecisionListener] = []
        self.last: dict[Pool, Decision] = {}
        self.measured: Measurements | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=50)  # the scaling decisions, newest last
        self._changed_at: dict[Pool, float] = {}
        self._acting: dict[Pool, asyncio.Task] = {}
        self._logged: dict[Pool, tuple[Any, ...]] = {}
        self._task: asyncio.Task | None = None
        self.threshold: ThresholdDecision | None = None  # the last local-prefill threshold decision
        self.threshold_listeners: list[Callable[[ThresholdDecision], None]] = []
        self._threshold_changed_at: float | None = None
        self._threshold_logged: tuple[Any, ...] = ()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop deciding; a start still waiting is abandoned (the pool's shutdown stops its worker)."""
        tasks = [t for t in (self._task, *self._acting.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def observe_finished(self, out: RequestOutput) -> None:
        """A finished request (the server's metrics hand each one over): its TTFT and TPOT."""
        self.window.add_finished(out)

    async def _run(self) -> None:
        next_decision = time.monotonic() + self.config.interval_s
        while True:
            await asyncio.sleep(self.sample_s)
            now = time.monotonic()
            try:
                self._sample(now)
                if now >= next_decision:
                    next_decision = now + self.config.interval_s
                    self._tick(now)
            except Exception:  # NOTE: a bad tick must not end autoscaling: the next one measures afresh
                logger.exception("autoscaler: a tick failed")

    # ---- measuring ----------------------------------------------------------------------------

    def _sample(self, now: float) -> None:
        workers = [w for w in self.router.pool.workers.values() if w.alive]
        decode = [w for w in workers if w.role.decodes]
        prefill = [w for w in workers if w.role == WorkerRole.PREFILL]
        encode = [w for w in workers if w.role == WorkerRole.ENCODE] if Pool.ENCODE in self.pools else None
        arrived, prefilled, images = self._flights.scan(self.router.flights)
        sample = PoolSample.of(now, decode, prefill if Pool.PREFILL in self.pools else None, encode,
                               sum(self.router.images_encoding().values()),
                               self.router.counters["encode_refused_images"])
        self.window.add_sample(sample, arrived, prefilled, images if encode is not None else 0)

    def _state(self, pool: Pool, now: float) -> PoolState:
        p = self.router.pool
        slots = [s for s in p.supervisor.slots.values() if s.state != SlotState.DOWN]
        mine = [s.name for s in slots if s.spec.role in _ROLES[pool]]
        serving = [n for n in mine if n not in p.workers or not p.workers[n].draining]
        starting = [n for n in mine if n not in p.workers and p.supervisor.slots[n].state == SlotState.UP]
        acting = pool in self._acting and not self._acting[pool].done()
        changed = self._changed_at.get(pool)
        return PoolState(num_workers=len(serving), num_starting=len(starting) + int(acting),
                         seconds_since_change=None if changed is None else now - changed,
                         room=max(0, self.max_workers - len(slots)))

    def _tick(self, now: float) -> None:
        states = {pool: self._state(pool, now) for pool in self.pools}
        m = self.window.measure(now, self.config, self.max_batch, {p: s.num_workers for p, s in states.items()},
                                self.router.pool.config.encode_queue)
        self.measured = m
        for pool in self.pools:
            verdict = _VERDICTS[pool](self.config, m)
            decision = decide(self.config, pool, verdict, states[pool])
            entry = self._record(decision, m)
            if entry is not None:
                self._changed_at[pool] = now
                self._acting[pool] = asyncio.create_task(self._act(decision, entry))
        if self.config.adapt_threshold and Pool.PREFILL in self.pools:
            self._tune_threshold(now, m, states[Pool.PREFILL])

    def _tune_threshold(self, now: float, m: Measurements, prefill: PoolState) -> None:
        """Move the local-prefill threshold from the decode workers' measured interference (see
        kvbaton.cluster.autoscale_threshold); logged, exported and kept in the history like a scaling decision."""
        _, high = self.config.bounds(Pool.PREFILL)
        can_grow = prefill.room > 0 and (high is None or prefill.num_workers + prefill.num_starting < high)
        since = None if self._threshold_changed_at is None else now - self._threshold_changed_at
        d = threshold_decision(self.config, m, self.router.config.local_prefill_threshold, can_grow, since)
        self.threshold = d
        key = (d.current, d.target, d.held_by)
        logger.log(logging.INFO if key != self._threshold_logged else logging.DEBUG, "%s", d.describe())
        self._threshold_logged = key
        for listener in self.threshold_listeners:
            listener(d)
        if not d.changed:
            return
        self.router.set_local_prefill_threshold(d.target)
        self._flights.prefill_threshold = d.target
        self._threshold_changed_at = now
        self.history.append({"at": time.time(), "pool": "local_prefill_threshold",
                             "action": "down" if d.target < d.current else "up", "from": d.current, "to": d.target,
                             "reason": d.reason, "workers": [], "result": "applied"})

    def _record(self, d: Decision, m: Measurements) -> dict[str, Any] | None:
        """Log, export and remember `d`; a scaling decision's history entry (its outcome to be filled in)."""
        self.last[d.pool] = d
        # NOTE: a hold is logged at INFO when it differs from the last one logged, else at DEBUG: at a 10 s
        # interval an unchanged hold every tick would bury the changes
        key = (d.action, d.current, d.target, d.held_by)
        logger.log(logging.INFO if key != self._logged.get(d.pool) else logging.DEBUG, "%s", d.describe())
        self._logged[d.pool] = key
        for listener in self.listeners:
            listener(d, m)
        if d.action == Action.HOLD:
            return None
        entry = {"at": time.time(), "pool": d.pool.value, "action": d.action.value, "from": d.current,
                 "to": d.target, "reason": d.reason, "workers": [], "result": "in progress"}
        self.history.append(entry)
        return entry

    # ---- acting -------------------------------------------------------------------------------

    async def _act(self, d: Decision, entry: dict[str, Any]) -> None:
        try:
            if d.action == Action.UP:
                for _ in range(d.target - d.current):
                    entry["workers"].append(await self.router.add_worker(_ADD_ROLE[d.pool]))
                await self.router.wait_for_workers(entry["workers"], self.router.pool.config.start_timeout_s)
                entry["result"] = "joined"
            else:
                name = self._drain_candidate(d.pool)
                if name is None:
                    entry["result"] = "nothing to drain"
                    return
                entry["workers"].append(name)
                await self.router.drain_worker(name)
                entry["result"] = "draining"
            logger.info("autoscaler: %s %s %s", d.pool.value, entry["result"], ", ".join(entry["workers"]))
        except (KeyError, ValueError) as exc:  # the pool refused the drain (it went meanwhile, an EP group)
            entry["result"] = f"refused: {exc}"
            logger.warning("autoscaler: %s %s refused: %s", d.action.value, d.pool.value, exc)
        except Exception as exc:
            entry["result"] = f"failed: {exc}"
            logger.error("autoscaler: %s %s failed: %s", d.action.value, d.pool.value, exc)
        finally:
            self._changed_at[d.pool] = time.monotonic()  # NOTE: the cooldown counts from the change's end

    def _drain_candidate(self, pool: Pool) -> str | None:
        """The routable worker of `pool` with the least in flight: the one that leaves soonest."""
        workers = [w for w in self.router.pool.workers.values() if w.routable and w.role in _ROLES[pool]]
        return min(workers, key=lambda w: (len(w.attempts), w.load_score, w.name)).name if workers else None

    # ---- the JSON view ----------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """`GET /admin/autoscaler`: the configuration, each pool's size and last decision, the last
        measurements, and the recent scaling decisions with their outcome."""
        now = time.monotonic()
        pools = {}
        for pool in self.pools:
            state, last = self._state(pool, now), self.last.get(pool)
            pools[pool.value] = {"workers": state.num_workers, "starting": state.num_starting,
                                 "target": last.target if last else state.num_workers,
                                 "last_decision": dataclasses.asdict(last) if last else None,
                                 "seconds_since_change": state.seconds_since_change}
        threshold = None
        if self.config.adapt_threshold and Pool.PREFILL in self.pools:
            threshold = {"tokens": self.router.config.local_prefill_threshold,
                         "last_decision": dataclasses.asdict(self.threshold) if self.threshold else None}
        return {"config": dataclasses.asdict(self.config), "max_workers": self.max_workers, "pools": pools,
                "local_prefill_threshold": threshold,
                "measurements": dataclasses.asdict(self.measured) if self.measured else None,
                "scaling": list(self.history)}
