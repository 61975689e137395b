"""The four steps of the diagnosis, each a dict of measured figures (what `findings.py` judges).

    1 interconnect   each KV transport pair's latency and bandwidth, a gloo all-reduce (POST /admin/diagnostics/*)
    2 KV watermark   cache usage, preemptions, prefix and tier hits, the queue (/metrics, /stats, /workers)
    3 compute        each worker's compute path and a short profile of real steps, under a little traffic we send
    4 routing        prompt lengths against --local-prefill-threshold, and the router's counters

Steps 2 and 4 read the figures taken before our own traffic (step 3's), so the deployment's load is what is
judged, not ours; step 2's rates are over the window from the first snapshot to its own.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvbaton.doctor import thresholds as t
from kvbaton.doctor.client import DeploymentClient, EndpointError, Metrics, share_at_least

MIN_WINDOW_S = 2.0  # step 2's rates need some time between its two scrapes
ARM_S = 0.5  # time for the workers to arm their profilers before our traffic arrives
TOKEN_IDS = (10, 300)  # our traffic's prompt token ids: inside any vocabulary, even a test's tiny one


@dataclass(frozen=True, kw_only=True)
class Options:
    transfer_mb: float = 16.0
    repeats: int = 5
    allreduce_mb: float = 8.0
    profile_steps: int = 8
    profile_s: float = 10.0
    timeout_s: float = 30.0
    skip_profile: bool = False


@dataclass(frozen=True)
class Snapshot:
    at: float
    metrics: Metrics | None
    stats: dict[str, Any]
    routing: dict[str, Any]
    workers: list[dict[str, Any]]
    errors: list[str]


def snapshot(dep: DeploymentClient, workers: list[dict[str, Any]] | None = None) -> Snapshot:
    errors: list[str] = []

    def read(what: str, fetch: Any, default: Any) -> Any:
        try:
            return fetch()
        except EndpointError as exc:
            errors.append(f"{what}: {exc}")
            return default

    metrics = read("metrics", dep.metrics, None)
    stats = read("stats", lambda: dep.get("/stats"), {})
    routing = read("routing", lambda: dep.get("/admin/diagnostics/routing"), {})
    if workers is None:
        workers = read("workers", lambda: dep.get("/workers")["workers"], [])
    return Snapshot(time.monotonic(), metrics, stats, routing, workers, errors)


# ---- 1 -------------------------------------------------------------------------------------------------------


def interconnect(dep: DeploymentClient, snap: Snapshot, opts: Options) -> dict[str, Any]:
    fig: dict[str, Any] = {"transport": snap.routing.get("kv_transport"), "pairs": [], "all_reduce": {}, "errors": [],
                           "single_host": len({urlsplit(w.get("address", "")).hostname for w in snap.workers}) <= 1}
    wait_s = opts.timeout_s * 2 + 10  # the server's own bound on each probe, and then some
    try:
        kv = dep.post("/admin/diagnostics/kv-transfer", {"large_mb": opts.transfer_mb, "repeats": opts.repeats,
                                                         "timeout_s": opts.timeout_s}, wait_s)
        fig.update(transport=kv["transport"], pairs=kv["pairs"], skipped=kv.get("skipped"))
    except EndpointError as exc:
        fig["errors"].append(str(exc))
    try:
        fig["all_reduce"] = dep.post("/admin/diagnostics/all-reduce", {"large_mb": opts.allreduce_mb,
                                                                       "timeout_s": opts.timeout_s}, wait_s)
    except EndpointError as exc:
        fig["errors"].append(str(exc))
    return fig


# ---- 2 -------------------------------------------------------------------------------------------------------


def kv_watermark(first: Snapshot, now: Snapshot) -> dict[str, Any]:
    fig: dict[str, Any] = {"errors": list(now.errors)}
    m, before = now.metrics, first.metrics
    if m is None:
        return fig
    window_s = max(now.at - first.at, 1e-6)
    preemptions = m.total("kvbaton:num_preemptions")
    delta = preemptions - (before.total("kvbaton:num_preemptions") if before is not None else preemptions)
    finished = m.total("kvbaton:request_success_total")
    fig.update({
        "kv_cache_usage": m.total("kvbaton:kv_cache_usage_perc"),
        "kv_cache_waste": m.total("kvbaton:kv_cache_waste_perc"),
        "max_worker_kv_usage": max((w.get("kv_cache_usage") or 0.0 for w in now.workers), default=0.0),
        "num_running": m.total("kvbaton:num_requests_running"),
        "num_waiting": m.total("kvbaton:num_requests_waiting"),
        "num_preemptions": preemptions, "window_s": window_s, "preemptions_per_min": delta / window_s * 60,
        "finished_requests": finished,
        "preemptions_per_100_requests": 100 * preemptions / finished if finished else 0.0,
        "rejected": m.total("kvbaton:request_rejected_total"),
        "prefix_cache_hit_rate": m.total("kvbaton:prefix_cache_hit_rate"),
        "prefix_queries": now.stats.get("prefix_cache_queried_tokens", 0),
        "kv_store_hit_tokens": m.total("kvbaton:kv_store_hit_tokens"),
        "num_decode": now.routing.get("num_decode", 1), "routing": now.routing.get("decode_policy"),
        "tiers": _tiers(m)})
    return fig


def _tiers(m: Metrics) -> dict[str, dict[str, float]]:
    tiers: dict[str, dict[str, float]] = {}
    for field in ("hits", "misses", "errors", "dropped_writes", "used_bytes", "capacity_bytes"):
        for name, value in m.by_label(f"kvbaton:kv_store_{field}", "tier").items():
            tiers.setdefault(name, {})[field] = value
    for tier in tiers.values():
        lookups = tier.get("hits", 0) + tier.get("misses", 0)
        tier["hit_rate"] = tier.get("hits", 0) / lookups if lookups else 0.0
    return tiers


# ---- 3 -------------------------------------------------------------------------------------------------------


def compute(dep: DeploymentClient, snap: Snapshot, opts: Options) -> dict[str, Any]:
    workers = [{"name": w["name"], "role": w.get("role"), "compute_path": w.get("compute_path")}
               for w in snap.workers if w.get("healthy")]
    fig: dict[str, Any] = {"workers": workers, "errors": [], "traffic": None}
    if opts.skip_profile:
        fig["profile"] = "skipped (--skip-profile)"
        return fig
    body = {"num_steps": opts.profile_steps, "max_duration_s": opts.profile_s}
    with ThreadPoolExecutor(max_workers=4) as pool:
        profile = pool.submit(dep.post, "/admin/diagnostics/profile", body, opts.profile_s + 30)
        time.sleep(ARM_S)
        max_tokens = opts.profile_steps + 4
        threshold = int(snap.routing.get("local_prefill_threshold") or 0)
        prompt_len = min(max(2 * threshold, 256), _max_model_len(dep) - max_tokens - 1)
        fig["traffic"] = drive_traffic(dep, pool, prompt_len=max(prompt_len, 1), max_tokens=max_tokens)
        try:
            profiled = {w["name"]: w for w in profile.result()["workers"]}
        except EndpointError as exc:
            fig["errors"].append(str(exc))
            return fig
    for w in workers:
        w.update(profiled.get(w["name"], {}))
    return fig


def _max_model_len(dep: DeploymentClient) -> int:
    try:
        return int(dep.get("/v1/models")["data"][0]["max_model_len"])
    except (EndpointError, KeyError, IndexError, TypeError, ValueError):
        return 2048


def drive_traffic(dep: DeploymentClient, pool: ThreadPoolExecutor, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """Two long prompts (through the prefill pool, if any) and a short one, with distinct token ids (no prefix
    hit keeps them local), so every worker has real steps to profile."""
    rng = random.Random()
    prompts = [[rng.randrange(*TOKEN_IDS) for _ in range(n)] for n in (prompt_len, prompt_len, 8)]
    bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True} for p in prompts]
    answers = [pool.submit(dep.post, "/v1/completions", b, 120.0) for b in bodies]
    errors = []
    for answer in answers:
        try:
            answer.result()
        except EndpointError as exc:
            errors.append(str(exc))
    return {"requests": len(bodies), "prompt_tokens": [len(p) for p in prompts], "errors": errors}


# ---- 4 -------------------------------------------------------------------------------------------------------


def routing(snap: Snapshot) -> dict[str, Any]:
    r = snap.routing
    counters = r.get("counters", snap.stats.get("router", {}))
    fig: dict[str, Any] = {"errors": list(snap.errors), "local_prefill_threshold": r.get("local_prefill_threshold"),
                           "num_prefill": r.get("num_prefill", 0), "num_decode": r.get("num_decode", 0),
                           "kv_transport": r.get("kv_transport"), "counters": counters}
    dispatched = counters.get("disaggregated", 0) + counters.get("local", 0)
    fig["disaggregated_share"] = counters.get("disaggregated", 0) / dispatched if dispatched else None
    buckets = snap.metrics.buckets("kvbaton:request_prompt_tokens") if snap.metrics is not None else []
    fig["requests"] = int(buckets[-1][1]) if buckets else 0
    threshold = fig["local_prefill_threshold"]
    if not fig["requests"] or threshold is None:
        return fig
    at_threshold = share_at_least(buckets, threshold) or 0.0
    long_share = share_at_least(buckets, t.LONG_PROMPT_TOKENS) or 0.0
    short_share = share_at_least(buckets, t.SHORT_PROMPT_TOKENS) or 0.0
    fig.update({"share_at_least_threshold": at_threshold, "share_long": long_share,
                "share_long_local": max(0.0, long_share - at_threshold) if threshold > t.LONG_PROMPT_TOKENS else 0.0,
                "share_short_routed": max(0.0, at_threshold - short_share) if threshold < t.SHORT_PROMPT_TOKENS
                else 0.0,
                "prompt_tokens_buckets": [[_edge(edge), count] for edge, count in buckets]})
    return fig


def _edge(edge: float) -> float | str:
    return "+Inf" if edge == float("inf") else edge  # JSON has no infinity
