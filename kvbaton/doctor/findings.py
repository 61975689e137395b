"""What the measured figures of each step mean: findings, ranked by severity, each naming the flag to change.

Pure functions of a step's figures (the dicts `steps.py` measures), so each rule is checked on its own; the
thresholds they judge by are in `thresholds.py`, with why.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from kvbaton.doctor import thresholds as t


class Severity(enum.IntEnum):
    CRITICAL = 0  # requests are failing or about to be refused
    WARNING = 1  # measurably slower than it need be
    INFO = 2  # worth knowing; no action needed now


@dataclass(frozen=True)
class Finding:
    step: str
    severity: Severity
    message: str
    flag: str | None = None  # the flag (or command) that moves it

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "severity": self.severity.name.lower()}


def ranked(findings: list[Finding]) -> list[Finding]:
    """Most severe first; a step's own order within a severity."""
    return sorted(findings, key=lambda f: f.severity)


def _pct(x: float) -> str:
    return f"{x:.0%}"


# ---- step 1 ------------------------------------------------------------------------------------------------


def interconnect_findings(fig: dict[str, Any]) -> list[Finding]:
    out = [Finding("interconnect", Severity.WARNING, f"could not measure: {e}") for e in fig.get("errors", [])]
    transport = fig.get("transport", "?")
    for pair in fig.get("pairs", []):
        name = f"{pair['prefill']} -> {pair['decode']}"
        if pair.get("error"):
            out.append(Finding("interconnect", Severity.CRITICAL, f"KV transfer {name} over {transport} failed: "
                               f"{pair['error']}", "--kv-transport / --transfer-timeout"))
            continue
        gbps, latency = pair.get("large", {}).get("gbps", 0.0), pair.get("small", {}).get("median_ms", 0.0)
        if transport == "tcp" and gbps < t.TCP_SLOW_GBPS and fig.get("single_host"):
            out.append(Finding("interconnect", Severity.WARNING, f"tcp transport at {gbps:.2f} GB/s ({name}) "
                               "between workers on one host", "--kv-transport shm"))
        elif transport == "shm" and gbps < t.SHM_SLOW_GBPS:
            out.append(Finding("interconnect", Severity.INFO, f"shm transport at {gbps:.2f} GB/s ({name}): the "
                               "copies are starved for memory bandwidth or CPU", "--threads (leave a core free)"))
        if latency > t.TRANSFER_LATENCY_HIGH_MS:
            out.append(Finding("interconnect", Severity.WARNING, f"a one-block KV transfer takes {latency:.1f} ms "
                               f"({name}): short prompts pay it in TTFT", "--local-prefill-threshold (raise it)"))
    ar = fig.get("all_reduce", {})
    if ar.get("error"):
        out.append(Finding("interconnect", Severity.WARNING, f"gloo all-reduce failed: {ar['error']}"))
    for size in ar.get("sizes", [])[:1]:
        if size["median_us"] > t.ALLREDUCE_LATENCY_HIGH_US:
            out.append(Finding("interconnect", Severity.INFO, f"a {size['num_bytes']}-byte gloo all-reduce among "
                               f"{ar['world_size']} workers takes {size['median_us']:.0f} us: expert parallelism "
                               "pays a collective like it per MoE layer", "--expert-parallel-size (keep it small)"))
    return out


# ---- step 2 ------------------------------------------------------------------------------------------------


def kv_findings(fig: dict[str, Any]) -> list[Finding]:
    out = [Finding("kv", Severity.WARNING, f"could not measure: {e}") for e in fig.get("errors", [])]
    usage = max(fig.get("kv_cache_usage", 0.0), fig.get("max_worker_kv_usage", 0.0))
    per_100, per_min = fig.get("preemptions_per_100_requests", 0.0), fig.get("preemptions_per_min", 0.0)
    memory_flag = "--kv-cache-memory-gb (raise it) or --kv-cache-dtype fp8_e4m3"
    pressure = f"KV usage {_pct(usage)} with {per_min:.0f} preemptions/min ({per_100:.1f} per 100 requests)"
    if usage >= t.KV_USAGE_CRITICAL:
        out.append(Finding("kv", Severity.CRITICAL, pressure, memory_flag))
    elif usage >= t.KV_USAGE_HIGH or per_100 > t.PREEMPTIONS_PER_100_HIGH:
        out.append(Finding("kv", Severity.WARNING, pressure, memory_flag))
    if fig.get("num_waiting", 0) >= t.WAITING_HIGH and usage < t.KV_USAGE_LOW:
        out.append(Finding("kv", Severity.WARNING, f"{fig['num_waiting']:.0f} requests wait while KV is "
                           f"{_pct(usage)} used: the batch is capped by the scheduler's limits",
                           "--max-num-seqs / --max-num-batched-tokens (raise them)"))
    if fig.get("rejected", 0) > 0:
        out.append(Finding("kv", Severity.CRITICAL, f"{fig['rejected']:.0f} requests were refused by admission "
                           "control (503)", "--max-waiting-requests, or `kvbaton workers add decode`"))
    if fig.get("kv_cache_waste", 0.0) > t.KV_WASTE_HIGH:
        out.append(Finding("kv", Severity.INFO, f"{_pct(fig['kv_cache_waste'])} of allocated KV slots are unfilled",
                           "--block-size (lower it)"))
    if (fig.get("num_decode", 1) > 1 and fig.get("prefix_queries", 0) > 0
            and fig.get("prefix_cache_hit_rate", 1.0) < t.PREFIX_HIT_LOW and fig.get("routing") != "prefix_aware"):
        out.append(Finding("kv", Severity.INFO, f"prefix-cache hit rate {_pct(fig['prefix_cache_hit_rate'])} across "
                           f"{fig['num_decode']} decode workers", "--routing prefix_aware"))
    for name, tier in fig.get("tiers", {}).items():
        if tier.get("errors", 0) or tier.get("dropped_writes", 0):
            out.append(Finding("kv", Severity.WARNING, f"KV store tier {name}: {tier.get('errors', 0):.0f} I/O errors,"
                               f" {tier.get('dropped_writes', 0):.0f} dropped writes", f"--kv-store-{name}-gb / "
                               "the tier's health"))
    return out


# ---- step 3 ------------------------------------------------------------------------------------------------


def compute_findings(fig: dict[str, Any]) -> list[Finding]:
    out = [Finding("compute", Severity.INFO, f"could not measure: {e}") for e in fig.get("errors", [])]
    for w in fig.get("workers", []):
        path = w.get("compute_path") or ""
        if path.startswith("torch"):
            out.append(Finding("compute", Severity.WARNING, f"{w['name']} computes with PyTorch ops only, without "
                               "kvbaton's C kernels", "--compute-path auto (drop --no-kernels; needs a C compiler)"))
        if "[float32]" in path:
            out.append(Finding("compute", Severity.INFO, f"{w['name']} runs the model in float32: twice the weight "
                               "bytes per decode step of bfloat16", "--dtype bfloat16"))
        if w.get("error"):
            out.append(Finding("compute", Severity.INFO, f"no profile of {w['name']}: {w['error']}"))
        outside = w.get("outside_compute_share")
        if outside is not None and outside > t.OUTSIDE_COMPUTE_HIGH:
            out.append(Finding("compute", Severity.WARNING, f"{w['name']} ({w['role']}): {_pct(outside)} of step time "
                               "is outside the compute kernels (framework overhead, small ops, sampling)",
                               "--compile, or bigger batches (--max-num-seqs)"))
    by_role: dict[str, set[str]] = {}
    for w in fig.get("workers", []):
        by_role.setdefault(w.get("role", "?"), set()).add(w.get("compute_path") or "")
    for role, paths in by_role.items():
        if len(paths) > 1:
            out.append(Finding("compute", Severity.INFO, f"{role} workers run different compute paths: "
                               f"{'; '.join(sorted(p.split(':')[0] for p in paths))}", "--compute-path"))
    return out


# ---- step 4 ------------------------------------------------------------------------------------------------


def routing_findings(fig: dict[str, Any]) -> list[Finding]:
    out = [Finding("routing", Severity.INFO, f"could not measure: {e}") for e in fig.get("errors", [])]
    threshold, requests = fig.get("local_prefill_threshold"), fig.get("requests", 0)
    num_prefill = fig.get("num_prefill", 0)
    fallbacks = fig.get("counters", {}).get("fallbacks", 0)
    if fallbacks:
        out.append(Finding("routing", Severity.WARNING, f"{fallbacks} disaggregated requests fell back to a local "
                           "prefill (a transfer failed or timed out)", "--transfer-timeout, and step 1's transport"))
    if threshold is None or requests < t.MIN_REQUESTS:
        out.append(Finding("routing", Severity.INFO, f"only {requests} finished requests so far: the prompt-length "
                           "shares are too thin to act on"))
        return out
    long_share, long_local = fig.get("share_long", 0.0), fig.get("share_long_local", 0.0)
    if num_prefill and long_local > t.LONG_LOCAL_SHARE_HIGH:
        out.append(Finding("routing", Severity.WARNING, f"{_pct(long_local)} of prompts are >= {t.LONG_PROMPT_TOKENS} "
                           f"tokens yet below the threshold ({threshold}): they are prefilled locally",
                           f"--local-prefill-threshold {t.LONG_PROMPT_TOKENS // 2}"))
    elif num_prefill and fig.get("share_at_least_threshold", 0.0) < t.PREFILL_SHARE_LOW:
        out.append(Finding("routing", Severity.INFO, f"only {_pct(fig['share_at_least_threshold'])} of prompts reach "
                           f"the prefill pool (threshold {threshold}): it is mostly idle",
                           "--local-prefill-threshold (lower it) or fewer --prefill workers"))
    if not num_prefill and long_share > t.LONG_SHARE_NO_POOL:
        out.append(Finding("routing", Severity.WARNING, f"{_pct(long_share)} of prompts are >= "
                           f"{t.LONG_PROMPT_TOKENS} tokens and prefill on the decode workers, stalling their decodes",
                           "--prefill 1 (a prefill pool)"))
    if num_prefill and threshold < t.SHORT_PROMPT_TOKENS and fig.get("share_short_routed", 0.0) > t.SHORT_SHARE_HIGH:
        out.append(Finding("routing", Severity.INFO, f"{_pct(fig['share_short_routed'])} of prompts are under "
                           f"{t.SHORT_PROMPT_TOKENS} tokens yet go through the prefill pool, paying a transfer",
                           f"--local-prefill-threshold {t.SHORT_PROMPT_TOKENS}"))
    return out
