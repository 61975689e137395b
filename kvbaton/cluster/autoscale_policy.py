"""The SLA autoscaler's decisions, pure: measurements in, a target size per pool out (no I/O, no clock).

Decode pool (colocated replicas when there is no prefill pool), after Dynamo's SLA planner but learnt
online instead of from a pre-deployment profile:

    feasible batch  B = the largest per-worker batch whose predicted TPOT p99 stays under the SLO, from a
                        line fitted to observed (batch, TPOT) pairs plus their worst residual; at most the
                        engine's max_num_seqs
    demand          D = running + waiting (+ receiving) requests on the decode workers
    scale up to     ceil(D / (B * up_fill))                     (interval mean of D)
    scale down by 1 when ceil(D / (B * down_fill)) < n          (interval max of D), and TPOT, KV usage
                        and (colocated) TTFT and the queue are calm

Prefill pool:

    capacity        C = prompt tokens one busy prefill worker computes per second (measured)
    load            L = prompt tokens arriving per second (the last interval's: a constant predictor)
    scale up to     ceil(L / (C * up_fill));   down by 1 when ceil(L / (C * down_fill)) < n

Encoder pool (E/P/D), the prefill pool's rule in images:

    capacity        C = images one busy encoder worker encodes per second (its own count)
    load            L = images arriving per second at the encoder pool (the last interval's)
    scale up to     ceil(L / (C * up_fill));   down by 1 when ceil(L / (C * down_fill)) < n
    pressure        images refused for the queue's bound in the last interval, or queued at half the admission
                    bound (`--encode-queue` per worker): the next burst would be refused

Pressure adds a worker whatever the formulas say: TPOT p99 over the SLO, KV usage at `kv_high`, and
for colocated replicas (which prefill too) TTFT p99 over the SLO or `queue_high` waiting requests per
worker; for the prefill pool, TTFT p99 over the SLO with requests waiting for a prefill worker.

Hysteresis: up_fill > down_fill (a pool grows at 100% of its capacity and shrinks only if the rest
would run at 60%), up from the interval mean and down from the interval max. A pool that just
changed holds for `cooldown_s`, and one with a worker still starting holds until it has joined.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbaton.config import ConfigError
from kvbaton.sched.info import DecodeStepTimes


class Pool(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"  # decode workers, or colocated replicas (role `both`) when there is no prefill pool
    ENCODE = "encode"  # encoder workers (E/P/D)


class Action(str, enum.Enum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True, kw_only=True)
class AutoscaleConfig:
    slo_ttft_s: float
    slo_tpot_s: float
    min_prefill: int = 1
    max_prefill: int | None = None  # None: only --max-workers bounds it
    min_decode: int = 1
    max_decode: int | None = None
    min_encode: int = 1
    max_encode: int | None = None
    interval_s: float = 10.0  # between decisions
    cooldown_s: float = 30.0  # after a change, the pool holds this long
    window_s: float = 60.0  # TTFT / TPOT percentiles over the requests finished this recently
    up_fill: float = 1.0  # scale up once demand needs more than this fraction of the pool's capacity
    down_fill: float = 0.6  # scale down only if the smaller pool would run at most this full
    kv_high: float = 0.9  # KV usage that is pressure to scale up (preemptions come next)
    queue_high: float = 1.0  # colocated: mean waiting requests per worker that are pressure to scale up
    # PD: move the local-prefill threshold from measured interference (see kvbaton.cluster.autoscale_threshold)
    adapt_threshold: bool = False
    min_threshold: int = 16  # tokens: the threshold halves no lower
    max_threshold: int = 4096  # ... and doubles no higher
    interference_high: float = 0.15  # share of decoding's step time that local prefills may take

    def __post_init__(self) -> None:
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ConfigError(f"the SLOs must be > 0 (got TTFT {self.slo_ttft_s * 1000:g} ms, "
                              f"TPOT {self.slo_tpot_s * 1000:g} ms)")
        for pool, low, high in (("prefill", self.min_prefill, self.max_prefill),
                                ("decode", self.min_decode, self.max_decode),
                                ("encode", self.min_encode, self.max_encode)):
            if low < 1:
                raise ConfigError(f"--min-{pool} must be >= 1, got {low}")
            if high is not None and high < low:
                raise ConfigError(f"--min-{pool} {low} is above --max-{pool} {high}")
        if not (self.interval_s > 0 and self.cooldown_s >= 0 and self.window_s > 0):
            raise ConfigError("the autoscale interval and window must be > 0 and the cooldown >= 0")
        if not 0 < self.down_fill < self.up_fill:
            raise ConfigError(f"need 0 < down_fill ({self.down_fill}) < up_fill ({self.up_fill}): the hysteresis")
        if not (0 < self.kv_high <= 1 and self.queue_high > 0):
            raise ConfigError("need 0 < kv_high <= 1 and queue_high > 0")
        if not 0 <= self.min_threshold <= self.max_threshold:
            raise ConfigError(f"need 0 <= --min-local-prefill-threshold ({self.min_threshold}) <= "
                              f"--max-local-prefill-threshold ({self.max_threshold})")
        if not 0 < self.interference_high < 1:
            raise ConfigError(f"need 0 < interference_high ({self.interference_high}) < 1")

    def bounds(self, pool: Pool) -> tuple[int, int | None]:
        return {Pool.PREFILL: (self.min_prefill, self.max_prefill), Pool.DECODE: (self.min_decode, self.max_decode),
                Pool.ENCODE: (self.min_encode, self.max_encode)}[pool]


@dataclass(frozen=True, kw_only=True)
class PoolLoad:
    """One pool as the autoscaler saw it over the last interval."""

    num_workers: int  # serving or starting (draining ones excluded: they are on their way out)
    demand_mean: float  # running + waiting (+ receiving) requests, summed over the pool, interval mean
    demand_max: float  # ... interval max
    waiting_mean: float
    kv_usage: float  # mean over the pool's workers, interval max


@dataclass(frozen=True, kw_only=True)
class EncodePoolLoad:
    """The encoder pool over the last interval."""

    num_workers: int
    queued_mean: float  # images waiting or encoding at the pool (the router's count), interval mean
    queued_max: float
    images_per_s: float  # images arriving, last interval
    images_per_s_window: float
    capacity_ips: float | None  # images per busy encoder-worker second (None: none encoded yet)
    queue_bound: int  # images per worker admission takes (--encode-queue)
    refused: int = 0  # images admission refused for that bound, last interval (demand the rate does not show)


@dataclass(frozen=True, kw_only=True)
class Measurements:
    ttft_p99_s: float | None  # over the window's finished requests (None: none finished)
    tpot_p99_s: float | None
    feasible_batch: int | None  # see `feasible_batch` (None: too few observations yet)
    max_batch: int  # the engine's max_num_seqs: no worker runs more at once
    decode: PoolLoad
    prefill: PoolLoad | None = None  # None: no prefill pool (colocated replicas)
    input_tps: float = 0.0  # prompt tokens arriving per second, last interval
    input_tps_window: float = 0.0  # ... over the window
    prefill_capacity_tps: float | None = None  # prompt tokens per busy prefill-worker second (None: not seen busy)
    decode_steps: DecodeStepTimes | None = None  # PD: the decode workers' steps over the last interval
    encode: EncodePoolLoad | None = None  # None: no encoder pool


@dataclass(frozen=True, kw_only=True)
class PoolState:
    num_workers: int
    num_starting: int  # launched, not joined yet
    seconds_since_change: float | None  # None: never changed by the autoscaler
    room: int  # workers the whole deployment may still add (--max-workers)


@dataclass(frozen=True, kw_only=True)
class Decision:
    pool: Pool
    action: Action
    current: int
    target: int
    reason: str
    held_by: str = ""  # a hold despite a wanted change: "max_workers", "starting" or "cooldown"

    def describe(self) -> str:
        return f"autoscaler: {self.action.value} {self.pool.value} {self.current}->{self.target}: {self.reason}"


# ---- the (batch, TPOT) model ---------------------------------------------------------------


def feasible_batch(pairs: Sequence[tuple[float, float]], slo_s: float, max_batch: int) -> int | None:
    """The largest per-worker batch whose TPOT p99 is predicted under `slo_s`, from (batch, TPOT seconds) pairs.

    A least-squares line TPOT = a + c * batch, shifted up by its worst residual (with few points the p99
    is the max), solved for the SLO. Without two distinct batch sizes (or with no slope to see) the line
    through the origin and the highest TPOT per request: pessimistic, so the pool grows early rather than late.
    """
    if len(pairs) < 3:
        return None
    batches, tpots = [b for b, _ in pairs], [t for _, t in pairs]
    mean_b, mean_t = sum(batches) / len(pairs), sum(tpots) / len(pairs)
    var_b = sum((b - mean_b) ** 2 for b in batches)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in pairs) / var_b if var_b > 0.5 else 0.0
    if slope <= 0:
        per_request = max(t / max(b, 1.0) for b, t in pairs)
        return _clamp_batch(slo_s / per_request, max_batch)
    intercept = mean_t - slope * mean_b
    margin = max(t - (intercept + slope * b) for b, t in pairs)
    return _clamp_batch((slo_s - intercept - margin) / slope, max_batch)


def _clamp_batch(batch: float, max_batch: int) -> int:
    return max(1, min(max_batch, math.floor(batch)))


# ---- targets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    target: int
    reason: str


def decode_verdict(c: AutoscaleConfig, m: Measurements) -> Verdict:
    """The decode pool's (or the colocated replicas') wanted size, and why."""
    load, n = m.decode, m.decode.num_workers
    batch = min(m.feasible_batch or m.max_batch, m.max_batch)
    need_up = math.ceil(load.demand_mean / (batch * c.up_fill))
    need_down = math.ceil(load.demand_max / (batch * c.down_fill))
    facts = [f"demand {load.demand_mean:.1f} (max {load.demand_max:.0f}) over feasible batch {batch}"
             f"{'' if m.feasible_batch else ' (max_num_seqs: no TPOT model yet)'}",
             f"TPOT p99 {_ms(m.tpot_p99_s)} (SLO {c.slo_tpot_s * 1000:.0f} ms)", f"KV {load.kv_usage:.0%}"]
    colocated = m.prefill is None
    if colocated:
        facts += [f"TTFT p99 {_ms(m.ttft_p99_s)} (SLO {c.slo_ttft_s * 1000:.0f} ms)",
                  f"waiting {load.waiting_mean:.1f}/interval"]
    pressure = _decode_pressure(c, m, colocated)
    if need_up > n or pressure:
        why = f"needs {need_up}" if need_up > n else f"pressure: {pressure}"
        return Verdict(max(need_up, n + 1 if pressure else n), f"{why}; " + ", ".join(facts))
    calm = n > 1 and need_down < n and _decode_calm(c, m, colocated)
    if calm:
        return Verdict(n - 1, f"{n - 1} would do (needs {need_down} at {c.down_fill:.0%} fill); " + ", ".join(facts))
    return Verdict(n, "within the band; " + ", ".join(facts))


def _decode_pressure(c: AutoscaleConfig, m: Measurements, colocated: bool) -> str:
    load, n = m.decode, m.decode.num_workers
    busy = load.demand_mean > 0
    if busy and m.tpot_p99_s is not None and m.tpot_p99_s > c.slo_tpot_s:
        return "TPOT p99 over the SLO"
    if load.kv_usage >= c.kv_high:
        return f"KV usage at {load.kv_usage:.0%}"
    if colocated and busy and m.ttft_p99_s is not None and m.ttft_p99_s > c.slo_ttft_s:
        return "TTFT p99 over the SLO"
    if colocated and load.waiting_mean >= c.queue_high * n:
        return f"{load.waiting_mean:.1f} requests waiting"
    return ""


def _decode_calm(c: AutoscaleConfig, m: Measurements, colocated: bool) -> bool:
    """Whether one worker fewer would still meet the SLOs, as far as the measurements tell."""
    load, n = m.decode, m.decode.num_workers
    if m.tpot_p99_s is not None and m.tpot_p99_s > c.slo_tpot_s:
        return False
    if load.kv_usage * n / (n - 1) >= c.kv_high * c.down_fill:
        return False
    if colocated and (load.waiting_mean >= c.queue_high * c.down_fill * (n - 1)
                      or (m.ttft_p99_s is not None and m.ttft_p99_s > c.slo_ttft_s * c.down_fill)):
        return False
    return True


def prefill_verdict(c: AutoscaleConfig, m: Measurements) -> Verdict:
    """The prefill pool's wanted size from predicted prompt tokens/s over one worker's measured throughput."""
    assert m.prefill is not None, "only a deployment with a prefill pool has a prefill verdict"
    load, n, cap = m.prefill, m.prefill.num_workers, m.prefill_capacity_tps
    facts = [f"input {m.input_tps:.0f} tok/s (window {m.input_tps_window:.0f})",
             f"capacity {'unmeasured' if cap is None else f'{cap:.0f}'} tok/s/worker",
             f"TTFT p99 {_ms(m.ttft_p99_s)} (SLO {c.slo_ttft_s * 1000:.0f} ms)", f"waiting {load.waiting_mean:.1f}"]
    need_up = math.ceil(m.input_tps / (cap * c.up_fill)) if cap else n
    rate_down = max(m.input_tps, m.input_tps_window)
    need_down = math.ceil(rate_down / (cap * c.down_fill)) if cap else (0 if rate_down == 0 else n)
    pressure = m.ttft_p99_s is not None and m.ttft_p99_s > c.slo_ttft_s and load.waiting_mean > 0
    if need_up > n or pressure:
        why = f"needs {need_up}" if need_up > n else "pressure: TTFT p99 over the SLO with prompts waiting"
        return Verdict(max(need_up, n + 1 if pressure else n), f"{why}; " + ", ".join(facts))
    ttft_ok = m.ttft_p99_s is None or m.ttft_p99_s <= c.slo_ttft_s * c.down_fill
    queue_ok = load.waiting_mean < c.down_fill * (n - 1)  # NOTE: a prompt in line for a moment is no pressure
    if n > 1 and need_down < n and ttft_ok and queue_ok:
        return Verdict(n - 1, f"{n - 1} would do (needs {need_down} at {c.down_fill:.0%} fill); " + ", ".join(facts))
    return Verdict(n, "within the band; " + ", ".join(facts))


def encode_verdict(c: AutoscaleConfig, m: Measurements) -> Verdict:
    """The encoder pool's wanted size from arriving images over one worker's measured images/s, and its queue."""
    assert m.encode is not None, "only a deployment with an encoder pool has an encode verdict"
    load, n, cap = m.encode, m.encode.num_workers, m.encode.capacity_ips
    half_bound = load.queue_bound * n / 2
    facts = [f"images {load.images_per_s:.1f}/s (window {load.images_per_s_window:.1f})",
             f"capacity {'unmeasured' if cap is None else f'{cap:.1f}'} images/s/worker",
             f"queued {load.queued_mean:.1f} (max {load.queued_max:.0f}, admission bound {load.queue_bound * n})",
             f"refused {load.refused}"]
    need_up = math.ceil(load.images_per_s / (cap * c.up_fill)) if cap else n
    rate_down = max(load.images_per_s, load.images_per_s_window)
    need_down = math.ceil(rate_down / (cap * c.down_fill)) if cap else (0 if rate_down == 0 else n)
    pressure = ("images refused for the queue's bound" if load.refused
                else "images queued at half the admission bound" if load.queued_mean >= half_bound else "")
    if need_up > n or pressure:
        why = f"needs {need_up}" if need_up > n else f"pressure: {pressure}"
        return Verdict(max(need_up, n + 1 if pressure else n), f"{why}; " + ", ".join(facts))
    queue_ok = load.queued_max < c.down_fill * load.queue_bound * (n - 1) / 2 and not load.refused
    if n > 1 and need_down < n and queue_ok:
        return Verdict(n - 1, f"{n - 1} would do (needs {need_down} at {c.down_fill:.0%} fill); " + ", ".join(facts))
    return Verdict(n, "within the band; " + ", ".join(facts))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


# ---- from a verdict to a decision -------------------------------------------------------------


def decide(c: AutoscaleConfig, pool: Pool, verdict: Verdict, state: PoolState) -> Decision:
    """Bounds, the deployment's room, the cooldown and a start in progress turn a verdict into an action.
    Up goes straight to the target; down goes one worker at a time (a drain takes its requests' time)."""
    low, high = c.bounds(pool)
    n = state.num_workers
    target = max(low, verdict.target if high is None else min(high, verdict.target))
    if target > n:
        target = min(target, n + state.room)
        if target <= n:
            return Decision(pool=pool, action=Action.HOLD, current=n, target=n, held_by="max_workers",
                            reason=f"wanted {verdict.target} but --max-workers allows no more; {verdict.reason}")
    target = max(target, n - 1)
    if target == n:
        return Decision(pool=pool, action=Action.HOLD, current=n, target=n, reason=verdict.reason)
    if state.num_starting:
        return Decision(pool=pool, action=Action.HOLD, current=n, target=n, held_by="starting",
                        reason=f"wanted {target}, {state.num_starting} worker(s) still starting; {verdict.reason}")
    since = state.seconds_since_change
    if since is not None and since < c.cooldown_s:
        return Decision(pool=pool, action=Action.HOLD, current=n, target=n, held_by="cooldown",
                        reason=f"wanted {target}, cooling down ({c.cooldown_s - since:.0f} s left); {verdict.reason}")
    action = Action.UP if target > n else Action.DOWN
    return Decision(pool=pool, action=action, current=n, target=target, reason=verdict.reason)


def check_deployment(c: AutoscaleConfig, num_prefill: int, num_decode: int, max_workers: int,
                     num_encode: int = 0) -> None:
    """ConfigError unless the deployment starts within the autoscaler's bounds (a pool of 0 prefill workers
    stays at 0: colocated replicas do not turn into a PD deployment; nor does one of 0 encoder workers)."""
    pools = [(Pool.DECODE, num_decode)] + ([(Pool.PREFILL, num_prefill)] if num_prefill else [])
    pools += [(Pool.ENCODE, num_encode)] if num_encode else []
    for pool, n in pools:
        low, high = c.bounds(pool)
        if n < low or (high is not None and n > high):
            raise ConfigError(f"--{pool.value} {n} is outside --min-{pool.value} {low} .. --max-{pool.value} "
                              f"{'(none)' if high is None else high}")
    if sum(c.bounds(pool)[0] for pool, _ in pools) > max_workers:
        raise ConfigError(f"the autoscaler's minimum pool sizes exceed --max-workers {max_workers}")
