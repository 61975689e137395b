"""Typed result records: what the benchmark JSON files hold, field by field.

A record is written with `to_json`, which is `dataclasses.asdict` except that a field declared
with `optional()` is left out while it is None. NOTE: that keeps the JSON keys exactly those of
the committed results in benchmarks/results/, written before the records were typed, where some
keys appear only for some engines (`preemptions` for kvbaton, `concurrency` for a server).
The containers around the records (one engine's result, the whole run) stay plain dicts: they
also carry `error` / `skipped` entries in place of a record, and the reports read them back
from JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

_OMIT = "omit_if_none"


def optional() -> Any:
    """A field that defaults to None and is left out of the JSON while it is None."""
    return field(default=None, metadata={_OMIT: True})


def to_json(value: Any) -> Any:
    """Records (nested in dicts and lists too) as JSON-ready dicts, as `dataclasses.asdict`
    writes them, less the `optional()` fields that are None."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)
                if not (f.metadata.get(_OMIT) and getattr(value, f.name) is None)}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


# ---- the machine and the model -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Environment:
    cpu: str
    cpus: int | None
    torch: str
    torch_cpu_capability: str
    cpu_features: str | None = optional()  # kvbaton.platform.cpu's summary: what the compute-path table saw
    transformers: str | None = optional()  # bench_engine (it runs HF as a peer)
    python: str
    kvbaton_commit: str  # "+dirty" when kvbaton/ has uncommitted changes
    peers: dict[str, str] | None = optional()  # bench_serve: peer name -> version


@dataclass(frozen=True, kw_only=True)
class Bandwidth:
    tensor_mb: int
    threads: int
    read_gb_s: float  # x.sum() over a tensor_mb fp32 tensor
    copy_gb_s: float  # read + write bytes of y.copy_(x)
    matvec_float32_gb_s: float  # weight bytes / time of an LM-head-shaped matvec
    matvec_bfloat16_gb_s: float


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    params: int
    vocab_size: int
    layers: int
    kv_heads: int
    head_dim: int
    tie_word_embeddings: bool


@dataclass(frozen=True, kw_only=True)
class Roofline:
    weight_bytes: int
    kv_bytes_per_token: int
    mean_context: float
    bytes_per_step: float
    read_gb_s: float
    roofline_ms_per_tok: float


# ---- bench_engine: batch-1 latency and offline throughput ----------------------------------


@dataclass(frozen=True, kw_only=True)
class Latency:
    """One request: TTFT, and decode time per token from the first to the last token."""

    ttft_s: float
    prefill_tok_s: float
    decode_ms_per_tok: float
    decode_ms_median_gap: float | None
    n_tokens: int
    chunks: int | None = optional()  # streamed over HTTP: stream chunks seen
    # the read bandwidth (GB/s) measured in the engine's own process just before and just after this request:
    # this host's bandwidth jumps between levels within minutes, so a roofline for this run needs its moment's
    read_gb_s_around: tuple[float, float] | None = optional()


@dataclass(frozen=True, kw_only=True)
class BestLatency:
    """Per metric the best of the repeats (min time, max rate); the repeats themselves too."""

    ttft_s: float
    prefill_tok_s: float
    decode_ms_per_tok: float
    decode_tok_s: float
    runs: list[Latency]


@dataclass(frozen=True, kw_only=True)
class Throughput:
    elapsed_s: float
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    preemptions: int | None = optional()  # kvbaton's own engine
    concurrency: int | None = optional()  # a server: requests in flight


@dataclass(frozen=True)
class ThroughputSkip:
    skipped: str
    predicted_s: float | None = optional()


@dataclass(frozen=True, kw_only=True)
class WorkerRun:
    """An engine measured in its own process (kvbaton's `LLM`, HF `generate`)."""

    load_s: float
    torch_threads: int
    version: str
    compile: bool | None = optional()  # kvbaton
    compute_path: str | None = optional()  # kvbaton: its ComputePlan, as logged at start-up
    attn_implementation: str | None = optional()  # HF
    probe_s: float | None  # the batched warm-up (None: no throughput run asked for)
    warmup_s: float
    latency: BestLatency
    throughput: Throughput | ThroughputSkip


@dataclass(frozen=True, kw_only=True)
class ServerMeasure:
    """An engine measured through its OpenAI HTTP server (vLLM, llama-server)."""

    probe_s: float | None = optional()
    warmup_s: float
    latency: BestLatency
    throughput: Throughput | ThroughputSkip | None = optional()


@dataclass(frozen=True, kw_only=True)
class LlamaBenchRow:
    n_prompt: int
    n_gen: int
    n_depth: int | None
    avg_ts: float
    stddev_ts: float | None


@dataclass(frozen=True)
class LlamaBench:
    pp_tok_s: float | None
    tg_tok_s_at_depth: float | None
    tg_depth: int | None
    tg_tok_s_depth0: float | None


# ---- bench_serve: one load-generator run, and (d) offline ----------------------------------


@dataclass(frozen=True, kw_only=True)
class ServeRun:
    """One load-generator run against a server, whichever client drove it."""

    client: str
    seed: int
    input_len: int
    cap_s: int | None = optional()  # ours only: vLLM's client has no duration cap
    command: str
    raw: str
    wall_s: float
    busy_before: float
    overlap: list[str]  # other benchmark processes seen during the run
    completed: int
    planned: int
    failed: int
    rejected: int
    cancelled: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    req_s: float
    output_tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tpot_mean_ms: float | None
    itl_p50_ms: float | None
    e2e_p50_ms: float | None
    first_error: str | None = optional()


@dataclass(frozen=True, kw_only=True)
class OfflineVariant:
    kwargs: dict[str, int]
    load_s: float
    elapsed_s: float
    output_tokens: int
    prompt_tokens: int | None
    output_tok_s: float
    torch_threads: int
    preemptions: int | None = optional()


@dataclass(frozen=True)
class OfflineRun:
    prompts: int
    prompt_tokens: int
    variants: dict[str, OfflineVariant]


# ---- bench_pd: one set-up under the mixed workload -----------------------------------------


@dataclass(frozen=True, kw_only=True)
class PdWorkload:
    quick: bool
    setups: str
    num_prompts: int
    rate: float
    seed: int
    tpot_slos_ms: list[float]
    long_fraction: float
    long_len: int
    short_len: int
    output_len: int
    ttft_slo_ms: float
    report: str | None = None  # the markdown report's name (None: pd.md / pd-quick.md)


@dataclass(frozen=True, kw_only=True)
class SetupScore:
    completed: int
    planned: int
    duration_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    out_tok_s: float
    goodput: dict[str, float]  # TPOT SLO (ms, as text) -> requests/s meeting both SLOs
    server_args: list[str]
    workers: list[Any]  # the server's /workers answer
