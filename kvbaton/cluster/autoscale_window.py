"""What the autoscaler saw recently: pool samples, arriving prompts, finished prefills and finished requests
over a sliding window, turned into `Measurements`; and the (batch, TPOT) pairs its TPOT model is learnt
from, kept longer (they describe the hardware, not the load)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbaton.cluster.autoscale_policy import (
    AutoscaleConfig,
    EncodePoolLoad,
    Measurements,
    Pool,
    PoolLoad,
    feasible_batch,
)
from kvbaton.router.flight import Flight
from kvbaton.router.worker_pool import WorkerHandle
from kvbaton.sched.info import DecodeStepTimes
from kvbaton.text.request_output import RequestOutput


@dataclass(frozen=True)
class RoleLoad:
    demand: int  # running + waiting + receiving requests, summed over the role's workers
    waiting: int
    kv_usage: float  # mean over the role's workers

    @classmethod
    def of(cls, workers: Sequence[WorkerHandle]) -> RoleLoad:
        stats = [w.load.stats for w in workers]
        demand = sum(s.num_running + s.num_waiting for s in stats) + sum(w.load.num_receiving for w in workers)
        kv = sum(s.kv_cache_usage for s in stats) / len(stats) if stats else 0.0
        return cls(demand, sum(s.num_waiting for s in stats), kv)


@dataclass(frozen=True, kw_only=True)
class PoolSample:
    at: float  # monotonic
    decode: RoleLoad
    prefill: RoleLoad | None  # None: no prefill pool
    batch: float  # running requests per decode worker: what one worker's TPOT depends on
    busy_prefill: int  # prefill workers with a prompt running or waiting
    decode_steps: Mapping[str, DecodeStepTimes] = field(default_factory=dict)  # PD: per decode worker, cumulative
    encode_queued: int = 0  # images waiting or encoding at the encoder pool (the router's flights)
    encode_refused: int = 0  # images admission refused for the encoder pool's bound, since start (the router's)
    # the encoder workers' (images encoded, seconds encoding), summed, cumulative (None: no encoder pool)
    encoded: tuple[int, float] | None = None

    @classmethod
    def of(cls, at: float, decode: Sequence[WorkerHandle], prefill: Sequence[WorkerHandle] | None,
           encode: Sequence[WorkerHandle] | None = None, encode_queued: int = 0,
           encode_refused: int = 0) -> PoolSample:
        running = sum(w.load.stats.num_running for w in decode)
        busy = sum(1 for w in prefill or () if w.load.stats.num_running + w.load.stats.num_waiting > 0)
        steps = {w.name: w.load.stats.decode_steps for w in decode} if prefill is not None else {}
        loads = [w.load.encode for w in encode or () if w.load.encode is not None]
        encoded = (sum(x.encoded for x in loads), sum(x.busy_s for x in loads)) if encode is not None else None
        return cls(at=at, decode=RoleLoad.of(decode), prefill=None if prefill is None else RoleLoad.of(prefill),
                   batch=running / len(decode) if decode else 0.0, busy_prefill=busy, decode_steps=steps,
                   encode_queued=encode_queued, encode_refused=encode_refused, encoded=encoded)


class FlightWatch:
    """Arrivals and finished prefills, from the router's flights as they come and go between two scans.

    NOTE: a request that arrives and finishes between two scans (a quarter second) is not seen: the
    load it would add is that small."""

    def __init__(self, prefill_threshold: int) -> None:
        self.prefill_threshold = prefill_threshold  # PD: shorter prompts prefill on the decode worker
        self._seen: set[str] = set()
        self._prefilling: set[str] = set()

    def scan(self, flights: Mapping[str, Flight]) -> tuple[int, int, int]:
        """(prompt tokens that arrived for the prefill pool, prompt tokens a prefill worker computed, images that
        arrived) since the last scan."""
        arrived = prefilled = images = 0
        for rid in flights.keys() - self._seen:
            if len(flights[rid].prompt_token_ids) >= self.prefill_threshold:
                arrived += len(flights[rid].prompt_token_ids)
            images += len(flights[rid].images)
            self._prefilling.add(rid)
        for rid in list(self._prefilling):
            flight = flights.get(rid)
            if flight is None or flight.tokens:
                self._prefilling.discard(rid)
            if flight is not None and flight.tokens and flight.prefill is not None:
                prefilled += len(flight.prompt_token_ids) - (flight.num_cached_tokens or 0)
        self._seen = set(flights)
        return arrived, prefilled, images



def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class LoadWindow:
    def __init__(self, window_s: float, max_pairs: int = 512) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, PoolSample]] = deque()  # (seconds since the previous one, sample)
        self.arrivals: deque[tuple[float, int]] = deque()  # (time, prompt tokens)
        self.prefilled: deque[tuple[float, int]] = deque()
        self.images: deque[tuple[float, int]] = deque()  # (time, images arriving)
        self.finished: deque[tuple[float, float | None, float | None]] = deque()  # (finished, TTFT, TPOT)
        self.pairs: deque[tuple[float, float]] = deque(maxlen=max_pairs)  # (per-worker batch, TPOT s)
        self._started: float | None = None

    def add_sample(self, sample: PoolSample, arrived: int, prefilled: int, images: int = 0) -> None:
        dt = sample.at - self.samples[-1][1].at if self.samples else 0.0
        self._started = sample.at if self._started is None else self._started
        self.samples.append((dt, sample))
        if arrived:
            self.arrivals.append((sample.at, arrived))
        if prefilled:
            self.prefilled.append((sample.at, prefilled))
        if images:
            self.images.append((sample.at, images))
        self._prune(sample.at)

    def add_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        n = len(out.outputs[0].token_ids)
        first = m.first_token_time
        tpot = (m.finished_time - first) / (n - 1) if first is not None and n > 1 else None
        self.finished.append((m.finished_time, m.ttft, tpot))
        if tpot is not None and first is not None:
            batches = [s.batch for _, s in self.samples if first <= s.at <= m.finished_time]
            if batches:  # NOTE: a request shorter than a sample period says nothing of its batch
                self.pairs.append((sum(batches) / len(batches), tpot))

    def _prune(self, now: float) -> None:
        start = now - self.window_s
        for series in (self.arrivals, self.prefilled, self.images, self.finished):
            while series and series[0][0] < start:
                series.popleft()
        while self.samples and self.samples[0][1].at < start:
            self.samples.popleft()

    def measure(self, now: float, c: AutoscaleConfig, max_batch: int, num_workers: Mapping[Pool, int],
                encode_queue: int = 0) -> Measurements:
        """The window as the policy's input; pool loads over the last interval, latencies over the window
        (`encode_queue`: the images per encoder worker admission takes)."""
        samples = [s for _, s in self.samples]
        recent = [s for s in samples if s.at >= now - c.interval_s] or samples[-1:]
        prefill = None
        if Pool.PREFILL in num_workers:
            prefill = _pool_load(num_workers[Pool.PREFILL], [s.prefill for s in recent if s.prefill is not None])
        busy_s = sum(dt * s.busy_prefill for dt, s in self.samples)
        elapsed = min(self.window_s, now - self._started) if self._started is not None else 0.0
        return Measurements(
            ttft_p99_s=p99([t for _, t, _ in self.finished if t is not None]),
            tpot_p99_s=p99([t for _, _, t in self.finished if t is not None]),
            feasible_batch=feasible_batch(list(self.pairs), c.slo_tpot_s, max_batch), max_batch=max_batch,
            decode=_pool_load(num_workers[Pool.DECODE], [s.decode for s in recent]), prefill=prefill,
            input_tps=sum(n for t, n in self.arrivals if t >= now - c.interval_s) / c.interval_s,
            input_tps_window=sum(n for _, n in self.arrivals) / elapsed if elapsed > 0 else 0.0,
            prefill_capacity_tps=sum(n for _, n in self.prefilled) / busy_s if busy_s >= 1.0 else None,
            decode_steps=_steps_over(samples[-len(recent) - 1:]) if prefill is not None and recent else None,
            encode=self._encode_load(now, c, num_workers[Pool.ENCODE], recent, elapsed, encode_queue)
            if Pool.ENCODE in num_workers else None)

    def _encode_load(self, now: float, c: AutoscaleConfig, num_workers: int, recent: Sequence[PoolSample],
                     elapsed: float, queue_bound: int) -> EncodePoolLoad:
        queued = [s.encode_queued for s in recent] or [0]
        refused = 0
        if recent:  # NOTE: counted from the sample before the interval (`recent` is the window's tail)
            first = len(self.samples) - len(recent)
            before = self.samples[first - 1][1] if first > 0 else recent[0]
            refused = recent[-1].encode_refused - before.encode_refused
        encoded = [s.encoded for s in recent if s.encoded is not None]
        images, busy_s = encoded[-1] if encoded else (0, 0.0)
        return EncodePoolLoad(
            num_workers=num_workers, queued_mean=sum(queued) / len(queued), queued_max=max(queued),
            images_per_s=sum(n for t, n in self.images if t >= now - c.interval_s) / c.interval_s,
            images_per_s_window=sum(n for _, n in self.images) / elapsed if elapsed > 0 else 0.0,
            capacity_ips=images / busy_s if images and busy_s > 0 else None, queue_bound=queue_bound,
            refused=max(0, refused))


def _steps_over(samples: Sequence[PoolSample]) -> DecodeStepTimes:
    """The decode workers' steps over `samples`, each worker's from the first sample that shows it (one that
    joined meanwhile counts from then) to the last; one that restarted (its counters went back) or left counts
    nothing."""
    total, firsts = DecodeStepTimes(), dict[str, DecodeStepTimes]()
    for sample in samples:
        for name, times in sample.decode_steps.items():
            firsts.setdefault(name, times)
    for name, now in samples[-1].decode_steps.items():
        delta = now.since(firsts[name])
        if min(delta.decode_only_steps, delta.mixed_steps) >= 0:
            total += delta
    return total


def _pool_load(num_workers: int, loads: Sequence[RoleLoad]) -> PoolLoad:
    if not loads:
        return PoolLoad(num_workers=num_workers, demand_mean=0.0, demand_max=0.0, waiting_mean=0.0, kv_usage=0.0)
    return PoolLoad(num_workers=num_workers, demand_mean=sum(x.demand for x in loads) / len(loads),
                    demand_max=max(x.demand for x in loads), waiting_mean=sum(x.waiting for x in loads) / len(loads),
                    kv_usage=max(x.kv_usage for x in loads))
