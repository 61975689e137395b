"""Prometheus metrics (prefix `kvbaton:`), on a registry owned by the server instance."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbaton.cluster.autoscale_policy import Action, Decision, Measurements
from kvbaton.cluster.autoscale_threshold import ThresholdDecision
from kvbaton.sched.info import EngineStats
from kvbaton.text.request_output import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)

# prompt lengths in tokens, edges at 2**i - 1: bucket `le=1023` counts the prompts of fewer than 1024 tokens, so
# the share a power-of-two --local-prefill-threshold keeps local is read off exactly (`kvbaton doctor`)
PROMPT_TOKEN_BUCKETS = tuple(float(2**i - 1) for i in range(4, 18))

# KV store tiers, one series per tier (summed over workers; occupancy of a shared tier counted once)
_TIER_GAUGES = {
    "hits": "Blocks loaded from the tier", "misses": "Lookups the tier could not serve (corrupt and failed included)",
    "bytes_read": "Payload bytes loaded from the tier", "bytes_written": "Payload bytes written to the tier",
    "read_seconds": "Seconds spent in loads that hit (over hits: mean load latency)",
    "write_seconds": "Seconds spent in writes", "used_bytes": "Bytes the tier holds",
    "capacity_bytes": "Bytes the tier may hold", "blocks": "Blocks the tier holds",
    "evictions": "Blocks evicted for room", "expirations": "Blocks dropped past their TTL",
    "corrupt": "Blocks whose header or MAC did not match (each a miss)",
    "errors": "I/O failures (server gone, disk full), each degraded to a miss or a skipped write",
    "dropped_writes": "Writes skipped (writer behind, tier down)",
}
# attention/FFN disaggregation, summed over the live workers since they started (`sched.info.AfdStats`)
_AFD_GAUGES = {  # metric name: (AfdStats field, help)
    "attention_bubble_ratio": ("attention_bubble", "Share of the attention workers' step time spent waiting for the "
                                                   "expert pool (0..1)"),
    "expert_bubble_ratio": ("expert_bubble", "Share of the expert workers' time spent waiting for rows (0..1)"),
    "exchanges": ("exchanges", "Dispatch/combine exchanges (one per MoE layer and micro-batch)"),
    "attention_wait_seconds": ("attention_wait_s", "Seconds the attention workers waited for the expert pool"),
    "attention_step_seconds": ("attention_step_s", "Seconds of the attention workers' model steps"),
    "expert_busy_seconds": ("expert_busy_s", "Seconds the expert workers computed"),
    "sent_bytes": ("bytes_sent", "Bytes the attention workers dispatched to the expert pool"),
    "received_bytes": ("bytes_received", "Bytes they took back"),
}
# vision-language models: the workers' encoder caches (mm/encoder_cache.py), summed
_ENCODER_CACHE_GAUGES = {
    "hits": "Images whose embeddings the encoder cache held, since start",
    "misses": "Images not in the encoder cache (encoded, or found in the shared tier), since start",
    "shared_hits": "Of those, images whose embeddings the shared tier held (another worker encoded them)",
    "evictions": "Encoder-cache entries no request held, dropped for its byte bound, since start",
    "bytes": "Bytes of image embeddings in the encoder caches",
    "entries": "Images in the encoder caches",
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"kvbaton:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvbaton:{name}", doc, labels, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens")
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first, per request")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = hist("request_queue_time_seconds", "Time a request waited before it was first scheduled")
        self.request_prompt_tokens = Histogram("kvbaton:request_prompt_tokens", "Prompt length of finished requests, "
                                               "in tokens", labels, buckets=PROMPT_TOKEN_BUCKETS,
                                               registry=self.registry)
        self.prompt_tokens = Counter("kvbaton:prompt_tokens", "Prompt tokens processed", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("kvbaton:generation_tokens", "Tokens generated", labels,
                                         registry=self.registry)
        self.requests = Counter("kvbaton:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("kvbaton:request_rejected", "Requests refused by admission control", labels,
                                registry=self.registry)
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.kv_waste = gauge("kv_cache_waste_perc", "Allocated-but-unused KV slots over allocated slots (0..1)")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hit rate over all lookups (0..1)")
        self.preemptions = gauge("num_preemptions", "Preemptions since start")
        self.store_hit_tokens = gauge("kv_store_hit_tokens", "Prompt tokens loaded from the KV store tiers since start")
        self.afd = {field: gauge(f"afd_{name}", doc) for name, (field, doc) in _AFD_GAUGES.items()}
        self.encoder_cache = {field: gauge(f"encoder_cache_{field}", doc)
                              for field, doc in _ENCODER_CACHE_GAUGES.items()}
        self.tier = {name: Gauge(f"kvbaton:kv_store_{name}", doc, labels + ["tier"], registry=self.registry)
                     for name, doc in _TIER_GAUGES.items()}
        # NOTE: one series per MoE layer and expert (e.g. 48 x 128 for a Qwen3-MoE-30B): what EPLB balances. In a
        # registry of their own: they say as much of the traffic as GET /experts, so only its users see them.
        self.expert_registry = CollectorRegistry()
        self.expert_tokens = Gauge("kvbaton:expert_tokens", "Tokens routed to each expert over the load window",
                                   labels + ["layer", "expert"], registry=self.expert_registry)
        self.expert_balancedness = Gauge("kvbaton:expert_balancedness", "Mean over max expected tokens per rank of "
                                         "an expert-parallel group, per MoE layer (1: even)",
                                         labels + ["ep_group", "layer"], registry=self.expert_registry)
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []  # e.g. the autoscaler's window

    def observe_stats(self, stats: EngineStats) -> None:
        m = self._model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.kv_waste.labels(m).set(stats.kv_waste_fraction)
        self.prefix_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        self.preemptions.labels(m).set(stats.num_preemptions)
        self.store_hit_tokens.labels(m).set(stats.kv_store_hit_tokens)
        if stats.afd is not None:
            for name, gauge in self.afd.items():
                gauge.labels(m).set(getattr(stats.afd, name))
        if stats.encoder_cache is not None:
            for name, gauge in self.encoder_cache.items():
                gauge.labels(m).set(getattr(stats.encoder_cache, name))
        for tier in stats.kv_store:
            for name, gauge in self.tier.items():
                gauge.labels(m, tier.name).set(getattr(tier, name))

    def observe_experts(self, view: dict[str, Any] | None) -> None:
        """`GET /experts`'s figures as gauges: tokens per layer and expert, balancedness per EP group and layer."""
        if view is None:
            return
        m = self._model
        for layer, row in zip(view["layers"], view["tokens"]):
            for expert, tokens in enumerate(row):
                self.expert_tokens.labels(m, str(layer), str(expert)).set(tokens)
        for group in view["groups"]:
            for layer, balance in zip(view["layers"], group["balancedness"]):
                self.expert_balancedness.labels(m, group["ep_group"], str(layer)).set(balance)

    def observe_token(self, gap_s: float | None) -> None:
        if gap_s is not None:
            self.itl.labels(self._model).observe(gap_s)

    def observe_finished(self, out: RequestOutput) -> None:
        m, completion, metrics = self._model, out.outputs[0], out.metrics
        for listener in self.finished_listeners:
            listener(out)
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.request_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(len(completion.token_ids))
        self.requests.labels(m, completion.finish_reason or "abort").inc()
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.labels(m).observe(metrics.ttft)
        if metrics.queue_time is not None:
            self.queue.labels(m).observe(max(metrics.queue_time, 0.0))
        if metrics.finished_time is not None:
            self.e2e.labels(m).observe(metrics.finished_time - metrics.arrival_time)
            n = len(completion.token_ids)
            if metrics.first_token_time is not None and n > 1:
                self.tpot.labels(m).observe((metrics.finished_time - metrics.first_token_time) / (n - 1))


class AutoscalerMetrics:
    """The SLA autoscaler's decisions (`serve --autoscale`), on the server's registry: every decision by pool and
    action, each pool's target, what the last decision saw, and the last scaling decision with its reason."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels, self._model = ["model_name", "pool"], model_name
        self.decisions = Counter("kvbaton:autoscaler_decisions", "Autoscaler decisions (one per pool and interval)",
                                 labels + ["action"], registry=registry)
        self.target = Gauge("kvbaton:autoscaler_target_workers", "Workers the autoscaler wants", labels,
                            registry=registry)
        self.measured = Gauge("kvbaton:autoscaler_measured", "What the autoscaler's last decision saw",
                              ["model_name", "quantity"], registry=registry)
        self.last = Gauge("kvbaton:autoscaler_last_scaling", "The last scale-up or -down (value: its Unix time); "
                          "its sizes and reason as labels", labels + ["action", "from_workers", "to_workers", "reason"],
                          registry=registry)
        self._last: dict[str, tuple[str, ...]] = {}  # pool -> the labels of its one `last` series
        self.threshold = Gauge("kvbaton:local_prefill_threshold_tokens", "PD: prompts with fewer uncached tokens "
                               "prefill on their decode worker (moved by `--adapt-threshold`)", ["model_name"],
                               registry=registry)
        self.threshold_changes = Counter("kvbaton:autoscaler_threshold_changes", "Local-prefill threshold changes "
                                         "from measured interference", ["model_name", "direction"], registry=registry)
        self.interference = Gauge("kvbaton:decode_prefill_interference", "PD: the share of the decode workers' step "
                                  "time that local prefills took over the last interval", ["model_name"],
                                  registry=registry)

    def observe(self, d: Decision, seen: Measurements) -> None:
        m, pool = self._model, d.pool.value
        self.decisions.labels(m, pool, d.action.value).inc()
        self.target.labels(m, pool).set(d.target)
        for quantity, value in (("ttft_p99_seconds", seen.ttft_p99_s), ("tpot_p99_seconds", seen.tpot_p99_s),
                                ("feasible_batch", seen.feasible_batch), ("input_tokens_per_second", seen.input_tps)):
            if value is not None:
                self.measured.labels(m, quantity).set(value)
        if seen.decode_steps is not None and seen.decode_steps.prefill_share is not None:
            self.interference.labels(m).set(seen.decode_steps.prefill_share)
        if d.action == Action.HOLD:
            return
        if pool in self._last:
            self.last.remove(*self._last[pool])
        self._last[pool] = (m, pool, d.action.value, str(d.current), str(d.target), d.reason)
        self.last.labels(*self._last[pool]).set(time.time())

    def observe_threshold(self, d: ThresholdDecision) -> None:
        self.threshold.labels(self._model).set(d.target)
        if d.changed:
            self.threshold_changes.labels(self._model, "down" if d.target < d.current else "up").inc()
