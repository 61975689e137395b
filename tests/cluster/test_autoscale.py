"""The SLA autoscaler's pure parts: the (batch, TPOT) model, the per-pool verdicts and their hysteresis, bounds,
cooldown and --max-workers, the window that turns samples into measurements, and the configuration's checks.
The live load step is tests/server/test_autoscale_serving.py."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import textwrap

import pytest

from kvbaton.cluster import autoscale, autoscale_policy, autoscale_window
from kvbaton.cluster.autoscale_policy import (
    Action,
    AutoscaleConfig,
    EncodePoolLoad,
    Measurements,
    Pool,
    PoolLoad,
    PoolState,
    Verdict,
    check_deployment,
    decide,
    decode_verdict,
    encode_verdict,
    feasible_batch,
    prefill_verdict,
)
from kvbaton.cluster.autoscale_threshold import threshold_decision
from kvbaton.cluster.autoscale_window import FlightWatch, LoadWindow, PoolSample, RoleLoad, p99
from kvbaton.config import ConfigError
from kvbaton.router.flight import Flight
from kvbaton.sched.info import DecodeStepTimes
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.request_output import CompletionOutput, RequestMetrics, RequestOutput

CONFIG = AutoscaleConfig(slo_ttft_s=1.0, slo_tpot_s=0.1, interval_s=1.0, cooldown_s=5.0, window_s=10.0)


def load(n: int, demand: float, demand_max: float | None = None, waiting: float = 0.0, kv: float = 0.1) -> PoolLoad:
    return PoolLoad(num_workers=n, demand_mean=demand, demand_max=demand if demand_max is None else demand_max,
                    waiting_mean=waiting, kv_usage=kv)


def measured(decode: PoolLoad, *, feasible: int | None = 8, tpot: float | None = 0.05, ttft: float | None = 0.2,
             prefill: PoolLoad | None = None, **kw: float | None) -> Measurements:
    return Measurements(ttft_p99_s=ttft, tpot_p99_s=tpot, feasible_batch=feasible, max_batch=16, decode=decode,
                        prefill=prefill, **kw)  # type: ignore[arg-type]


def state(n: int, *, starting: int = 0, since: float | None = None, room: int = 10) -> PoolState:
    return PoolState(num_workers=n, num_starting=starting, seconds_since_change=since, room=room)


# ---- the (batch, TPOT) model ---------------------------------------------------------------


def test_feasible_batch_solves_the_fitted_line_plus_its_worst_residual_for_the_slo():
    pairs = [(b, 0.02 + 0.01 * b) for b in (1, 2, 4, 6)]  # exact line: TPOT(8) = 0.1
    assert feasible_batch(pairs, 0.1, 64) == 8
    noisy = pairs + [(4, 0.02 + 0.04 + 0.02)]  # 20 ms over the line at batch 4: the p99 carries that margin
    assert feasible_batch(noisy, 0.1, 64) < 8
    assert feasible_batch(pairs, 1.0, 16) == 16  # never beyond max_num_seqs
    assert feasible_batch(pairs, 0.001, 64) == 1  # an SLO nothing meets: one request per worker
    assert feasible_batch(pairs[:2], 0.1, 64) is None  # too few observations


def test_without_a_slope_the_model_is_pessimistic_through_the_origin():
    same_batch = [(4.0, 0.05), (4.0, 0.06), (4.0, 0.055)]
    assert feasible_batch(same_batch, 0.1, 64) == 6  # 0.1 / (0.06 / 4) = 6.7
    falling = [(1.0, 0.05), (2.0, 0.04), (3.0, 0.03)]  # noise, not physics: no negative slope is trusted
    assert feasible_batch(falling, 0.1, 64) == 2


# ---- decode (and colocated) verdicts --------------------------------------------------------


def test_decode_scales_to_demand_over_the_feasible_batch():
    v = decode_verdict(CONFIG, measured(load(1, 20.0), prefill=load(1, 0.0)))
    assert v.target == 3 and v.reason.startswith("needs 3") and "feasible batch 8" in v.reason
    # no TPOT model yet: the engine's max_num_seqs is the batch
    assert decode_verdict(CONFIG, measured(load(1, 20.0), feasible=None, prefill=load(1, 0))).target == 2


def test_decode_hysteresis_holds_between_the_two_thresholds():
    pd = load(1, 0.0)
    # 2 workers x 8: up only beyond 16; down only if demand fits 1 worker at 60% (4.8)
    assert decode_verdict(CONFIG, measured(load(2, 10.0), prefill=pd)).target == 2
    assert decode_verdict(CONFIG, measured(load(2, 6.0), prefill=pd)).target == 2
    down = decode_verdict(CONFIG, measured(load(2, 4.0), prefill=pd))
    assert down.target == 1 and "needs 1 at 60% fill" in down.reason
    # the interval's max decides a scale-down: one burst in it keeps the pool
    assert decode_verdict(CONFIG, measured(load(2, 4.0, demand_max=9), prefill=pd)).target == 2


@pytest.mark.parametrize("kw, why", [
    ({"tpot": 0.2}, "TPOT p99 over the SLO"),
    ({"kv": 0.95}, "KV usage at 95%"),
    ({"ttft": 3.0}, "TTFT p99 over the SLO"),
    ({"waiting": 2.5}, "2.5 requests waiting"),
])
def test_pressure_adds_a_replica_whatever_the_batch_formula_says(kw, why):
    tpot, ttft = kw.pop("tpot", 0.05), kw.pop("ttft", 0.2)
    v = decode_verdict(CONFIG, measured(load(2, 4.0, **kw), tpot=tpot, ttft=ttft))
    assert v.target == 3 and why in v.reason


def test_ttft_and_queue_count_for_colocated_replicas_only():
    slow_prefill = {"ttft": 3.0}
    assert decode_verdict(CONFIG, measured(load(2, 6.0), **slow_prefill)).target == 3
    assert decode_verdict(CONFIG, measured(load(2, 6.0), prefill=load(1, 2.0), **slow_prefill)).target == 2


def test_no_scale_down_while_an_slo_is_missed_or_the_smaller_pool_would_queue():
    assert decode_verdict(CONFIG, measured(load(2, 1.0), ttft=0.2)).target == 1
    assert decode_verdict(CONFIG, measured(load(2, 1.0), ttft=0.8)).target == 2  # TTFT above 60% of its SLO
    assert decode_verdict(CONFIG, measured(load(2, 1.0, waiting=0.7))).target == 2
    assert decode_verdict(CONFIG, measured(load(2, 1.0, kv=0.3))).target == 2  # 60% on one worker: too full
    assert decode_verdict(CONFIG, measured(load(1, 0.0))).target == 1  # one is the least a verdict asks


# ---- prefill verdicts --------------------------------------------------------------------


def test_prefill_scales_predicted_tokens_over_measured_throughput():
    m = measured(load(2, 2.0), prefill=load(1, 1.0), input_tps=2500.0, input_tps_window=1500.0,
                 prefill_capacity_tps=1000.0)
    v = prefill_verdict(CONFIG, m)
    assert v.target == 3 and "input 2500 tok/s" in v.reason and "capacity 1000 tok/s/worker" in v.reason
    calm = measured(load(2, 2.0), prefill=load(3, 0.0), input_tps=500.0, input_tps_window=1000.0,
                    prefill_capacity_tps=1000.0)
    assert prefill_verdict(CONFIG, calm).target == 2  # the window's 1000 tok/s fit 2 workers at 60%
    busy_window = measured(load(2, 2.0), prefill=load(2, 0.0), input_tps=500.0, input_tps_window=1500.0,
                           prefill_capacity_tps=1000.0)
    assert prefill_verdict(CONFIG, busy_window).target == 2  # 1500 needs 3 at 60%: keep 2


def test_prefill_pressure_and_an_unmeasured_capacity():
    queued = measured(load(1, 1.0), prefill=load(1, 3.0, waiting=2.0), ttft=2.0, input_tps=10.0,
                      prefill_capacity_tps=1000.0)
    assert prefill_verdict(CONFIG, queued).target == 2
    unknown = measured(load(1, 1.0), prefill=load(2, 0.0), input_tps=100.0)
    assert prefill_verdict(CONFIG, unknown).target == 2  # no throughput seen: no formula, hold
    idle = measured(load(1, 0.0), prefill=load(2, 0.0), ttft=None)
    assert prefill_verdict(CONFIG, idle).target == 1  # nothing arrives: the least it may be


def encoders(n: int, *, queued: float = 0.0, queued_max: float | None = None, rate: float = 0.0,
             rate_window: float | None = None, capacity: float | None = 10.0) -> EncodePoolLoad:
    return EncodePoolLoad(num_workers=n, queued_mean=queued, queued_max=queued if queued_max is None else queued_max,
                          images_per_s=rate, images_per_s_window=rate if rate_window is None else rate_window,
                          capacity_ips=capacity, queue_bound=8)


def refusing_reason(m: Measurements) -> str:
    return encode_verdict(CONFIG, m).reason


def test_the_encoder_pool_scales_arriving_images_over_measured_images_per_second():
    def target(pool: EncodePoolLoad) -> int:
        return encode_verdict(CONFIG, measured(load(1, 1.0), encode=pool)).target

    assert target(encoders(1, rate=25.0)) == 3  # 25 images/s over 10 per worker
    assert target(encoders(3, rate=5.0, rate_window=10.0)) == 2  # the window's 10/s fit 2 at 60%
    assert target(encoders(2, rate=5.0, rate_window=15.0)) == 2  # 15/s needs 3 at 60%: keep 2
    assert target(encoders(2, rate=1.0, queued=8.0)) == 3  # half the admission bound (2 x 8) queued: pressure
    refusing = measured(load(1, 1.0), encode=dataclasses.replace(encoders(2, rate=1.0), refused=3))
    assert encode_verdict(CONFIG, refusing).target == 3 and "refused for the queue's bound" in refusing_reason(refusing)
    assert target(encoders(2, rate=1.0, queued=1.0, queued_max=5.0)) == 2  # the smaller pool would queue
    assert target(encoders(2, rate=30.0, capacity=None)) == 2  # nothing encoded yet: no formula, hold
    assert target(encoders(2, capacity=None)) == 1  # nothing arrives: the least it may be
    reason = encode_verdict(CONFIG, measured(load(1, 1.0), encode=encoders(1, rate=25.0))).reason
    assert "images 25.0/s" in reason and "capacity 10.0 images/s/worker" in reason and "bound 8" in reason


def test_the_window_measures_the_encoder_pool():
    window = LoadWindow(10.0)
    for i, (queued, encoded) in enumerate([(0, (0, 0.0)), (4, (10, 1.0)), (2, (30, 2.0))]):
        at = dataclasses.replace(sample(float(i), 1, 0), encode_queued=queued, encoded=encoded,
                                 encode_refused=[5, 7, 12][i])
        window.add_sample(at, 0, 0, images=6)
    m = window.measure(2.0, CONFIG, 16, {Pool.DECODE: 1, Pool.ENCODE: 2}, encode_queue=8)
    assert m.encode == EncodePoolLoad(num_workers=2, queued_mean=3.0, queued_max=4, images_per_s=12.0,
                                      images_per_s_window=9.0, capacity_ips=15.0, queue_bound=8,
                                      refused=7)  # 12 - 5: since the sample before the interval
    assert window.measure(2.0, CONFIG, 16, {Pool.DECODE: 1}).encode is None


# ---- from a verdict to an action ------------------------------------------------------------


def test_decide_bounds_room_starting_and_cooldown():
    c = AutoscaleConfig(slo_ttft_s=1, slo_tpot_s=0.1, min_decode=2, max_decode=4, cooldown_s=5)
    up = decide(c, Pool.DECODE, Verdict(9, "r"), state(2))
    assert (up.action, up.current, up.target) == (Action.UP, 2, 4)  # straight to the target, capped by max
    assert decide(c, Pool.DECODE, Verdict(9, "r"), state(2, room=1)).target == 3  # --max-workers
    full = decide(c, Pool.DECODE, Verdict(9, "r"), state(2, room=0))
    assert (full.action, full.held_by) == (Action.HOLD, "max_workers")
    down = decide(c, Pool.DECODE, Verdict(1, "r"), state(4))
    assert (down.action, down.target) == (Action.DOWN, 3)  # one at a time
    assert decide(c, Pool.DECODE, Verdict(1, "r"), state(2)).action == Action.HOLD  # min-decode
    assert decide(c, Pool.DECODE, Verdict(1, "r"), state(1)).action == Action.UP  # below the minimum
    assert decide(c, Pool.DECODE, Verdict(3, "r"), state(2, starting=1)).held_by == "starting"
    cooling = decide(c, Pool.DECODE, Verdict(3, "r"), state(2, since=2.0))
    assert cooling.held_by == "cooldown" and "3 s left" in cooling.reason
    assert decide(c, Pool.DECODE, Verdict(3, "r"), state(2, since=6.0)).action == Action.UP
    assert up.describe() == "autoscaler: up decode 2->4: r"


@pytest.mark.parametrize("kw, message", [
    ({"slo_tpot_s": -0.05}, "SLOs must be > 0"),
    ({"slo_ttft_s": 0.0}, "SLOs must be > 0"),
    ({"min_decode": 3, "max_decode": 2}, "--min-decode 3 is above --max-decode 2"),
    ({"min_prefill": 0}, "--min-prefill must be >= 1"),
    ({"interval_s": 0.0}, "interval"),
    ({"down_fill": 1.0}, "hysteresis"),
])
def test_bad_configurations_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        AutoscaleConfig(**{"slo_ttft_s": 1.0, "slo_tpot_s": 0.1, **kw})


def test_the_deployment_must_start_within_the_bounds():
    c = AutoscaleConfig(slo_ttft_s=1, slo_tpot_s=0.1, max_decode=2, min_prefill=2)
    check_deployment(c, num_prefill=0, num_decode=2, max_workers=4)  # colocated: prefill bounds do not apply
    with pytest.raises(ConfigError, match="--decode 3 is outside --min-decode 1 .. --max-decode 2"):
        check_deployment(c, 0, 3, 16)
    with pytest.raises(ConfigError, match="--prefill 1 is outside"):
        check_deployment(c, 1, 1, 16)
    with pytest.raises(ConfigError, match="exceed --max-workers 2"):
        check_deployment(c, 2, 1, 2)
    check_deployment(dataclasses.replace(c, min_encode=2), 0, 1, 4)  # --encode 0: the encode bounds do not apply
    with pytest.raises(ConfigError, match="--encode 3 is outside --min-encode 1 .. --max-encode 2"):
        check_deployment(dataclasses.replace(c, max_encode=2), 0, 1, 16, num_encode=3)


# ---- the window ---------------------------------------------------------------------------


def finished(first: float, end: float, tokens: int, arrival: float) -> RequestOutput:
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], finished=True,
                         outputs=[CompletionOutput(index=0, text="", token_ids=list(range(tokens)))],
                         metrics=RequestMetrics(arrival_time=arrival, first_token_time=first, finished_time=end))


def sample(at: float, running: int, waiting: int, workers: int = 1, busy_prefill: int = 0) -> PoolSample:
    return PoolSample(at=at, decode=RoleLoad(running + waiting, waiting, 0.2), prefill=RoleLoad(0, 0, 0.0),
                      batch=running / workers, busy_prefill=busy_prefill)


def test_the_window_pairs_each_request_with_its_batch_and_measures_the_last_interval():
    w = LoadWindow(window_s=10.0)
    for i in range(20):  # 5 s at 0.25 s: 2 running, then 4 running + 4 waiting over the last second
        t = 100.0 + i * 0.25
        w.add_sample(sample(t, 2 if t < 104 else 4, 0 if t < 104 else 4, busy_prefill=1), arrived=100, prefilled=50)
    w.add_finished(finished(first=101.0, end=103.0, tokens=41, arrival=100.9))  # TPOT 50 ms at batch 2
    w.add_finished(finished(first=104.0, end=104.1, tokens=3, arrival=103.0))  # TTFT 1 s
    w.add_finished(finished(first=104.05, end=104.1, tokens=1, arrival=104.0))  # one token: no TPOT
    assert list(w.pairs) == [(2.0, pytest.approx(0.05)), (4.0, pytest.approx(0.05))]
    m = w.measure(104.8, CONFIG, 16, {Pool.DECODE: 1, Pool.PREFILL: 1})
    assert (m.decode.demand_mean, m.decode.demand_max, m.decode.waiting_mean) == (8.0, 8.0, 4.0)
    assert m.ttft_p99_s == pytest.approx(1.0) and m.tpot_p99_s == pytest.approx(0.05)
    assert m.input_tps == 400.0 and m.input_tps_window == pytest.approx(2000 / 4.8)
    assert m.prefill_capacity_tps == pytest.approx(1000 / 4.75)  # prefilled tokens per busy worker-second
    assert m.feasible_batch is None  # two pairs only
    w.add_sample(sample(120.0, 0, 0), 0, 0)  # 15 s later: the window has moved on
    later = w.measure(120.0, CONFIG, 16, {Pool.DECODE: 1})
    assert later.ttft_p99_s is None and later.decode.demand_max == 0 and later.prefill is None
    assert len(w.pairs) == 2  # the TPOT model outlives the window


def test_p99_is_the_max_of_a_small_sample():
    assert p99([]) is None and p99([3.0, 1.0, 2.0]) == 3.0
    assert p99([float(i) for i in range(1000)]) == 989.0


def test_flight_watch_counts_arrivals_and_prompts_through_a_prefill_worker():
    def flight(rid: str, n: int) -> Flight:
        return Flight(request_id=rid, prompt_token_ids=[1] * n, params=SamplingParams(), priority=0,
                      queue=asyncio.Queue())

    watch = FlightWatch(prefill_threshold=64)
    flights = {"a": flight("a", 100), "b": flight("b", 10)}
    assert watch.scan(flights) == (100, 0, 0)  # b is short: it is prefilled on its decode worker
    flights["a"].tokens, flights["a"].prefill, flights["a"].num_cached_tokens = [7], "kvbaton-prefill-0", 32
    flights["b"].tokens = [5]
    assert watch.scan(flights) == (0, 68, 0)  # a's uncached part went through the prefill pool
    assert watch.scan({}) == (0, 0, 0)


# ---- the local-prefill threshold -----------------------------------------------------------------

THRESHOLD = AutoscaleConfig(slo_ttft_s=1.0, slo_tpot_s=0.1, interval_s=1.0, cooldown_s=5.0, window_s=10.0,
                            adapt_threshold=True, min_threshold=16, max_threshold=1024, interference_high=0.15)


def steps(mixed: int, mixed_ms: float, decode_only: int = 100, decode_ms: float = 10.0) -> DecodeStepTimes:
    return DecodeStepTimes(decode_only, decode_only * decode_ms / 1000, mixed, mixed * mixed_ms / 1000)


def test_prefill_share_is_the_mixed_steps_time_beyond_a_decode_only_step():
    times = steps(mixed=10, mixed_ms=60.0)  # 1 s decode-only, 0.6 s mixed of which 0.1 s decoding's own
    assert times.prefill_share == pytest.approx(0.5 / 1.6)
    assert steps(mixed=10, mixed_ms=8.0).prefill_share == 0.0  # mixed steps no slower: no interference
    assert steps(mixed=0, mixed_ms=0.0).prefill_share == 0.0
    assert DecodeStepTimes(0, 0.0, 5, 0.3).prefill_share is None  # nothing to compare with
    later = times + steps(mixed=1, mixed_ms=100.0, decode_only=3)
    assert dataclasses.astuple(later.since(times)) == pytest.approx((3, 0.03, 1, 0.1))


def pd(tpot: float | None, ttft: float | None = 0.2, *, share_steps: DecodeStepTimes | None, waiting: float = 0.0
       ) -> Measurements:
    return measured(load(1, 2.0), tpot=tpot, ttft=ttft, prefill=load(1, 1.0, waiting=waiting),
                    decode_steps=share_steps)  # type: ignore[arg-type]


INTERFERING, QUIET = steps(mixed=20, mixed_ms=60.0), steps(mixed=20, mixed_ms=11.0)  # shares 0.5 / 0.02


@pytest.mark.parametrize("tpot, ttft, steps_, waiting, can_grow, want", [
    (0.09, 0.2, INTERFERING, 0.0, True, 64),  # interference near the TPOT SLO: halve
    (0.12, 0.2, INTERFERING, 0.0, True, 64),  # ... over it too
    (0.05, 0.2, INTERFERING, 0.0, True, 128),  # TPOT calm: interference is harmless
    (0.09, 0.2, QUIET, 0.0, True, 128),  # TPOT near, but not from local prefills
    (0.09, 2.0, INTERFERING, 3.0, True, 128),  # the prefill pool misses TTFT itself: no more prompts for it
    (0.05, 2.0, QUIET, 3.0, False, 256),  # prefill pool misses TTFT, cannot grow, decoding calm: double
    (0.05, 2.0, QUIET, 3.0, True, 128),  # ... but it can grow: adding prefill workers is the pool's answer
    (0.05, 2.0, QUIET, 0.0, False, 128),  # TTFT missed without prompts waiting for prefill
    (0.09, 2.0, QUIET, 3.0, False, 128),  # decoding near its SLO: keep the prompts off it
    (None, None, None, 0.0, True, 128),  # nothing measured
])
def test_threshold_moves_from_measured_interference(tpot, ttft, steps_, waiting, can_grow, want):
    d = threshold_decision(THRESHOLD, pd(tpot, ttft, share_steps=steps_, waiting=waiting), 128, can_grow, None)
    assert d.target == want and d.changed == (want != 128) and not d.held_by
    assert ("lower" if want < 128 else "raise" if want > 128 else "hold") in d.describe()
    if steps_ is not None:
        assert "local prefills took" in d.reason and "TPOT p99" in d.reason


def test_threshold_bounds_and_cooldown():
    near = pd(0.09, share_steps=INTERFERING)
    assert threshold_decision(THRESHOLD, near, 20, True, None).target == 16  # halves no lower than the minimum
    at_min = threshold_decision(THRESHOLD, near, 16, True, None)
    assert at_min.target == 16 and at_min.held_by == "min_threshold"
    assert "--min-local-prefill-threshold" in at_min.reason
    cooling = threshold_decision(THRESHOLD, near, 128, True, 2.0)
    assert cooling.target == 128 and cooling.held_by == "cooldown" and "wanted 64" in cooling.reason
    assert threshold_decision(THRESHOLD, near, 128, True, 6.0).target == 64  # the cooldown is over
    pressed = pd(0.05, 2.0, share_steps=QUIET, waiting=3.0)
    assert threshold_decision(THRESHOLD, pressed, 1000, False, None).target == 1024
    assert threshold_decision(THRESHOLD, pressed, 0, False, None).target == 16  # from 0, to the minimum
    outside = threshold_decision(THRESHOLD, pressed, 4096, False, None)  # started above the maximum: never lowered
    assert outside.target == 4096 and outside.held_by == "max_threshold"


def test_the_window_measures_decode_steps_over_the_last_interval_per_worker():
    w = LoadWindow(window_s=10.0)

    def at(t: float, **workers: DecodeStepTimes) -> PoolSample:
        return dataclasses.replace(sample(t, 2, 0), decode_steps=workers)

    w.add_sample(at(100.0, d0=steps(0, 0.0, decode_only=10)), 0, 0)
    w.add_sample(at(100.5, d0=steps(2, 50.0, decode_only=20), d1=steps(5, 50.0)), 0, 0)  # d1 joins
    w.add_sample(at(101.0, d0=steps(4, 50.0, decode_only=30), d1=steps(9, 50.0, decode_only=150)), 0, 0)
    m = w.measure(101.0, CONFIG, 16, {Pool.DECODE: 2, Pool.PREFILL: 1})
    # the interval is [100, 101]: d0 from its 100.0 counters, d1 from its first sample (it joined at 100.5)
    assert dataclasses.astuple(m.decode_steps) == pytest.approx((20 + 50, 0.2 + 0.5, 4 + 4, 0.2 + 0.2))
    w.add_sample(at(101.5, d0=steps(0, 0.0, decode_only=1)), 0, 0)  # d0 restarted: its counters went back
    m = w.measure(101.5, CONFIG, 16, {Pool.DECODE: 1, Pool.PREFILL: 1})
    assert m.decode_steps == DecodeStepTimes()  # a restarted worker tells nothing until its next sample
    assert w.measure(101.5, CONFIG, 16, {Pool.DECODE: 1}).decode_steps is None  # colocated: no threshold


# ---- one code path for every launcher --------------------------------------------------------


def test_the_autoscaler_acts_only_through_the_router():
    """It adds and drains through `Router.add_worker` / `drain_worker` (what `POST /admin/workers` calls), which
    start workers through the pool's `Launcher`: local processes and Ray actors alike. Nothing in the autoscaler
    knows a launcher or a backend."""
    for module in (autoscale, autoscale_policy, autoscale_window):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m and (m.startswith("kvbaton.cluster.") and "autoscale" not in m)}
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
            n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not {n for n in names if "launcher" in n.lower() or "backend" in n.lower()}, module.__name__
    calls = {n.func.attr for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(autoscale.Autoscaler._act))))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"add_worker", "drain_worker", "wait_for_workers"} <= calls


@pytest.mark.parametrize("flags, message", [
    (["--autoscale"], "--autoscale needs --slo-ttft-ms and --slo-tpot-ms"),
    (["--autoscale", "--slo-ttft-ms", "500", "--slo-tpot-ms", "-5"], "the SLOs must be > 0"),
    (["--autoscale", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--min-decode", "3", "--max-decode", "2"],
     "--min-decode 3 is above --max-decode 2"),
    (["--slo-ttft-ms", "500"], "add --autoscale"),
    (["--adapt-threshold"], "--adapt-threshold is the autoscaler's: add --autoscale"),
    (["--autoscale", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--adapt-threshold"], "needs a prefill pool"),
    (["--autoscale", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--prefill", "1", "--adapt-threshold",
      "--min-local-prefill-threshold", "512", "--max-local-prefill-threshold", "256"], "<= --max-local-prefill"),
    (["--autoscale", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--expert-parallel-size", "2"],
     "expert-parallel"),
])
def test_bad_serve_flags_are_one_line_errors(flags, message, capsys):
    from kvbaton.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbaton: error: ") and message in err and err.count("\n") == 1
