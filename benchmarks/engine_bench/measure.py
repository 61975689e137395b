"""The engine benchmark's workload sizes and how a run is timed and judged."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from common.log import log
from common.records import BestLatency, Latency, ThroughputSkip


@dataclass(frozen=True, kw_only=True)
class Sizes:
    prompt_len: int
    out_len: int
    tp_prompts: int
    latency_repeats: int
    bw_mb: int
    worker_timeout_s: int


FULL = Sizes(prompt_len=512, out_len=128, tp_prompts=64, latency_repeats=2, bw_mb=1024, worker_timeout_s=900)
QUICK = Sizes(prompt_len=128, out_len=32, tp_prompts=8, latency_repeats=1, bw_mb=256, worker_timeout_s=300)
PROBE_N, PROBE_OUT = 4, 4  # the batched warm-up: PROBE_N prompts of prompt_len tokens, PROBE_OUT tokens each


def latency_summary(t0: float, stamps: list[float], n_tokens: int, prompt_len: int,
                    chunks: int | None = None) -> Latency:
    """TTFT = first token; TPOT = (last - first) / (n - 1), so stream chunking does not matter."""
    ttft = stamps[0] - t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return Latency(ttft_s=ttft, prefill_tok_s=prompt_len / ttft,
                   decode_ms_per_tok=1e3 * (stamps[-1] - stamps[0]) / max(1, n_tokens - 1),
                   decode_ms_median_gap=1e3 * statistics.median(gaps) if gaps else None,
                   n_tokens=n_tokens, chunks=chunks)


def best_of(runs: list[Latency]) -> BestLatency:
    decode_ms = min(r.decode_ms_per_tok for r in runs)
    return BestLatency(ttft_s=min(r.ttft_s for r in runs), prefill_tok_s=max(r.prefill_tok_s for r in runs),
                       decode_ms_per_tok=decode_ms, decode_tok_s=1e3 / decode_ms, runs=runs)


def log_latency(tag: str, best: BestLatency) -> None:
    log(f"{tag} latency: {best.decode_ms_per_tok:.2f} ms/tok, prefill {best.prefill_tok_s:.0f} tok/s")


def throughput_skip(args: argparse.Namespace, latency: BestLatency, probe_s: float | None) -> ThroughputSkip | None:
    """Predict the throughput run's length from the engine's own figures (the batched warm-up
    scaled to `tp_prompts`, plus `out_len` batched decode steps taken as 4x a batch-1 step) and
    skip it, with the reason, when that exceeds --max-run-s. kvbaton's own (eager) run always goes."""
    if not args.tp or probe_s is None:
        return ThroughputSkip("latency only (throughput not requested for this variant)")
    s = args.sizes
    predicted = probe_s * s.tp_prompts / PROBE_N + s.out_len * 4 * latency.decode_ms_per_tok / 1e3
    if predicted <= args.max_run_s or args.always_tp:
        return None
    log(f"skipping throughput: predicted {predicted:.0f}s > --max-run-s {args.max_run_s:.0f}")
    return ThroughputSkip(f"predicted {predicted:.0f} s > --max-run-s {args.max_run_s:.0f} (a batch of "
                          f"{PROBE_N} prompts took {probe_s:.1f} s)", predicted)
