"""The doctor's judgement, rule by rule, on figures as its steps measure them; and the prompt-length shares read
off the server's real histogram."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvbaton.doctor import thresholds as t
from kvbaton.doctor.client import Metrics, share_at_least
from kvbaton.doctor.findings import (
    Severity,
    compute_findings,
    interconnect_findings,
    kv_findings,
    ranked,
    routing_findings,
)
from kvbaton.server.metrics import ServerMetrics
from kvbaton.text.request_output import CompletionOutput, RequestOutput


def _finished(num_prompt_tokens: int) -> RequestOutput:
    completion = CompletionOutput(index=0, text="", token_ids=[1], finish_reason="length")
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1] * num_prompt_tokens, outputs=[completion],
                         finished=True)


def test_prompt_shares_from_the_server_histogram():
    metrics = ServerMetrics("m")
    for n in [8] * 6 + [100] * 3 + [2000]:
        metrics.observe_finished(_finished(n))
    scraped = Metrics.parse(generate_latest(metrics.registry).decode())
    buckets = scraped.buckets("kvbaton:request_prompt_tokens")
    assert buckets[-1][1] == 10
    assert share_at_least(buckets, 64) == 0.4  # exact: the bucket edges are 2**i - 1
    assert share_at_least(buckets, 1024) == 0.1
    assert share_at_least(buckets, 1) == 1.0
    assert share_at_least([], 64) is None


def test_kv_pressure_names_the_memory_flags():
    found = kv_findings({"kv_cache_usage": 0.97, "preemptions_per_min": 12, "preemptions_per_100_requests": 3.0})
    assert found[0].severity == Severity.CRITICAL and "97%" in found[0].message and "12 preemptions/min" in \
        found[0].message
    assert "--kv-cache-memory-gb" in found[0].flag and "fp8_e4m3" in found[0].flag
    assert kv_findings({"kv_cache_usage": 0.3, "preemptions_per_100_requests": 0.0}) == []
    queue = kv_findings({"kv_cache_usage": 0.1, "num_waiting": 20, "rejected": 3})
    assert [f.severity for f in ranked(queue)] == [Severity.CRITICAL, Severity.WARNING]


def test_slow_tcp_on_one_host_suggests_shm():
    pair = {"prefill": "p0", "decode": "d0", "error": None, "small": {"median_ms": 2.0}, "large": {"gbps": 0.4}}
    found = interconnect_findings({"transport": "tcp", "single_host": True, "pairs": [pair], "all_reduce": {}})
    assert len(found) == 1 and found[0].flag == "--kv-transport shm" and "0.40 GB/s" in found[0].message
    assert interconnect_findings({"transport": "tcp", "single_host": False, "pairs": [pair], "all_reduce": {}}) == []
    failed = interconnect_findings({"transport": "shm", "pairs": [{**pair, "error": "peer gone"}], "all_reduce": {}})
    assert failed[0].severity == Severity.CRITICAL


def test_long_prompts_kept_local_lower_the_threshold():
    fig = {"local_prefill_threshold": 4096, "requests": 100, "num_prefill": 1, "share_long": 0.4,
           "share_long_local": 0.34, "share_at_least_threshold": 0.06, "counters": {}}
    found = routing_findings(fig)
    assert len(found) == 1 and "34%" in found[0].message
    assert found[0].flag == f"--local-prefill-threshold {t.LONG_PROMPT_TOKENS // 2}"
    thin = routing_findings({**fig, "requests": 3})
    assert thin[0].severity == Severity.INFO and "too thin" in thin[0].message
    no_pool = routing_findings({**fig, "num_prefill": 0, "share_long_local": 0.0})
    assert no_pool[0].flag == "--prefill 1 (a prefill pool)"


def test_compute_without_kernels_and_overhead():
    workers = [{"name": "d0", "role": "decode", "compute_path": "torch [float32]: ...", "outside_compute_share": 0.7},
               {"name": "d1", "role": "decode", "compute_path": "amx [bfloat16]: ...", "outside_compute_share": 0.2}]
    messages = [f.message for f in compute_findings({"workers": workers})]
    assert any("PyTorch ops only" in m for m in messages) and any("float32" in m for m in messages)
    assert any("70%" in m for m in messages) and any("different compute paths" in m for m in messages)
