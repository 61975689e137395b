"""What a frontend knows about an engine without asking it, and the checks it runs before sending a
request: torch-free, so the HTTP process and the router never load torch or the model code."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvbaton.config import VisionSpec
from kvbaton.kv.store.base import TierStats
from kvbaton.sched.kv_cache_manager import cdiv
from kvbaton.sched.sampling_params import INT64_MAX, INT64_MIN, InvalidRequestError, SamplingParams

MAX_LOGPROBS = 20  # as vLLM's default `max_logprobs`
MAX_STOP_TOKEN_IDS = 1024  # each is checked at every step of the request


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What a frontend needs to validate requests without asking the core."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    eos_token_ids: tuple[int, ...]
    compute_path: str = ""  # the engine's ComputePlan, one line (kvbaton.platform.compute)
    vision: VisionSpec | None = None  # a vision-language model's image placeholders (None: it takes no images)
    embedding_row_bytes: int = 0  # with `vision`: the bytes of one placeholder's embedding (hidden size x dtype)


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """A MoE model's routed tokens per layer and expert over the last `steps` steps (a worker's own requests;
    summed: a pool's), and, for an expert-parallel rank, where its group holds the experts (EPLB)."""

    layers: tuple[int, ...]  # the decoder layer of each MoE layer
    counts: tuple[tuple[int, ...], ...]  # [MoE layer][expert]
    window_steps: int
    steps: int  # recorded in the window (at most window_steps)
    ep_size: int = 1
    ep_rank: int = 0
    placement: tuple[tuple[int, ...], ...] = ()  # EP: per MoE layer, the expert each slot of the group holds
    rows_computed: int = 0  # EP: token-expert pairs this rank's experts computed (for other ranks too)
    bytes_sent: int = 0  # EP: bytes this rank's MoE exchanges sent to other ranks
    rebalances: int = 0  # EP: placements EPLB swapped in

    @classmethod
    def total(cls, parts: list[ExpertLoad]) -> ExpertLoad | None:
        """Counts summed over workers of the same model (the per-rank fields stay with each worker)."""
        if not parts:
            return None
        first = parts[0]
        counts = tuple(tuple(sum(p.counts[i][e] for p in parts) for e in range(len(row)))
                       for i, row in enumerate(first.counts))
        return cls(layers=first.layers, counts=counts, window_steps=first.window_steps,
                   steps=max(p.steps for p in parts))


@dataclass(frozen=True)
class DecodeStepTimes:
    """Cumulative wall time of the steps that advanced decoding sequences: those that only decoded, and the
    mixed ones that also computed prompt tokens (a local prefill chunked in). Their difference is what
    prefill interference costs decoding, which the autoscaler weighs against the local-prefill threshold."""

    decode_only_steps: int = 0
    decode_only_s: float = 0.0
    mixed_steps: int = 0
    mixed_s: float = 0.0

    def add(self, mixed: bool, seconds: float) -> DecodeStepTimes:
        return self + (DecodeStepTimes(0, 0.0, 1, seconds) if mixed else DecodeStepTimes(1, seconds))

    def since(self, earlier: DecodeStepTimes) -> DecodeStepTimes:
        return self._combine(earlier, -1)

    def __add__(self, other: DecodeStepTimes) -> DecodeStepTimes:
        return self._combine(other, 1)

    def _combine(self, other: DecodeStepTimes, sign: int) -> DecodeStepTimes:
        return DecodeStepTimes(self.decode_only_steps + sign * other.decode_only_steps,
                               self.decode_only_s + sign * other.decode_only_s,
                               self.mixed_steps + sign * other.mixed_steps, self.mixed_s + sign * other.mixed_s)

    @property
    def prefill_share(self) -> float | None:
        """The share of decoding's time that went to prompt tokens computed alongside: a mixed step's time
        beyond a decode-only step's mean, over all of it (None: no decode-only step to compare with)."""
        if not self.decode_only_steps or not self.mixed_steps:
            return None if not self.decode_only_steps else 0.0
        extra = max(0.0, self.mixed_s - self.mixed_steps * self.decode_only_s / self.decode_only_steps)
        return extra / (self.decode_only_s + self.mixed_s)


@dataclass(frozen=True, kw_only=True)
class AfdStats:
    """Attention/FFN disaggregation since its workers started: each side's time and how much of it waited on the
    other (the bubble). An attention worker reports the first half; the pool adds its expert workers' half."""

    exchanges: int = 0  # one per MoE layer and micro-batch
    attention_wait_s: float = 0.0  # attention blocked on the expert pool
    attention_step_s: float = 0.0  # the model steps those waits fell in
    bytes_sent: int = 0  # dispatched rows, as framed
    bytes_received: int = 0
    expert_busy_s: float = 0.0  # expert workers computing and answering
    expert_alive_s: float = 0.0  # expert workers' lifetimes, summed

    def __add__(self, other: AfdStats) -> AfdStats:
        return AfdStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def attention_bubble(self) -> float:
        """The share of the attention side's step time spent waiting for experts."""
        return min(1.0, self.attention_wait_s / self.attention_step_s) if self.attention_step_s > 0 else 0.0

    @property
    def expert_bubble(self) -> float:
        """The share of the expert side's life spent waiting for rows."""
        return max(0.0, 1.0 - self.expert_busy_s / self.expert_alive_s) if self.expert_alive_s > 0 else 0.0


@dataclass(frozen=True)
class EncoderCacheStats:
    """A worker's encoder cache (`mm/encoder_cache.py`): counters since it started, and what it holds now."""

    hits: int = 0  # images whose embeddings were cached
    misses: int = 0  # images not cached here: encoded, or found in the shared level
    evictions: int = 0  # unheld entries dropped for the byte bound
    bytes: int = 0
    entries: int = 0
    shared_hits: int = 0  # of the misses, those the shared level (`mm/shared_encodings.py`) held

    def __add__(self, other: EncoderCacheStats) -> EncoderCacheStats:
        return EncoderCacheStats(self.hits + other.hits, self.misses + other.misses,
                                 self.evictions + other.evictions, self.bytes + other.bytes,
                                 self.entries + other.entries, self.shared_hits + other.shared_hits)


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """One engine's (or, summed, one pool's) load and cache counters, as of its last step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced
    kv_slots_allocated: int = 0
    kv_slots_filled: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    kv_store_hit_tokens: int = 0  # prompt tokens loaded from the KV store instead of computed
    kv_store: tuple[TierStats, ...] = ()  # per tier, fastest first
    expert_load: ExpertLoad | None = None  # MoE models only
    decode_steps: DecodeStepTimes = DecodeStepTimes()
    afd: AfdStats | None = None  # an attention worker's exchanges (a pool's: both sides')
    encoder_cache: EncoderCacheStats | None = None  # vision-language models only

    @classmethod
    def total(cls, parts: list[EngineStats], cache_parts: list[EngineStats] | None = None) -> EngineStats:
        """Load counts summed over `parts`, KV usage averaged (each part is a fraction of its own pool); cache
        counters (prefix cache, KV store) summed over `cache_parts` (default: `parts`), which may include
        workers that take no load of their own (a PD pool's prefill workers)."""
        if not parts:
            return cls()
        cache = parts if cache_parts is None else cache_parts
        return cls(num_running=sum(s.num_running for s in parts), num_waiting=sum(s.num_waiting for s in parts),
                   kv_cache_usage=sum(s.kv_cache_usage for s in parts) / len(parts),
                   kv_slots_allocated=sum(s.kv_slots_allocated for s in parts),
                   kv_slots_filled=sum(s.kv_slots_filled for s in parts),
                   prefix_cache_queried_tokens=sum(s.prefix_cache_queried_tokens for s in cache),
                   prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in cache),
                   num_preemptions=sum(s.num_preemptions for s in parts),
                   kv_store_hit_tokens=sum(s.kv_store_hit_tokens for s in cache),
                   kv_store=merge_tier_stats([t for s in cache for t in s.kv_store]),
                   decode_steps=sum((s.decode_steps for s in parts), DecodeStepTimes()),
                   afd=sum((s.afd for s in parts if s.afd is not None), AfdStats()) if any(s.afd for s in parts)
                   else None,
                   encoder_cache=sum((s.encoder_cache for s in cache if s.encoder_cache is not None),
                                     EncoderCacheStats()) if any(s.encoder_cache for s in cache) else None)
        # NOTE: no expert_load: summed on every step it would cost layers x experts adds; GET /experts sums it

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def kv_waste_fraction(self) -> float:
        """Allocated-but-unused slots over allocated slots (internal fragmentation)."""
        if not self.kv_slots_allocated:
            return 0.0
        return 1.0 - self.kv_slots_filled / self.kv_slots_allocated


def merge_tier_stats(stats: list[TierStats]) -> tuple[TierStats, ...]:
    """One entry per tier name, in first-seen order: counters summed; occupancy and capacity summed for a
    tier of each worker's own (disk), taken once for one every worker shares (shm, redis)."""
    merged: dict[str, TierStats] = {}
    for t in stats:
        m = merged.get(t.name)
        if m is None:
            merged[t.name] = TierStats(**{f.name: getattr(t, f.name) for f in fields(TierStats)})
            continue
        for f in fields(TierStats):
            if f.name in ("name", "shared"):
                continue
            if t.shared and f.name in ("capacity_bytes", "used_bytes", "blocks"):
                setattr(m, f.name, max(getattr(m, f.name), getattr(t, f.name)))
            else:
                setattr(m, f.name, getattr(m, f.name) + getattr(t, f.name))
    return tuple(merged.values())


def validate_request(info: EngineInfo, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
    """Raise InvalidRequestError (naming the field) for a request the core cannot run.

    The one check every path runs (the router before any worker sees the request, the worker
    again, the offline API): whatever passes here the engine can carry and compute. The cheap
    length checks come first, the scan over every token id last."""
    if not token_ids:
        raise InvalidRequestError("prompt is empty", "prompt")
    if len(token_ids) >= info.max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(token_ids)} tokens but the model's context length is {info.max_model_len}; "
            f"it must be shorter to leave room for at least one generated token", "prompt")
    if cdiv(len(token_ids) + 1, info.block_size) > info.num_blocks:
        raise InvalidRequestError(
            f"prompt of {len(token_ids)} tokens cannot fit in the KV cache ({info.num_blocks} blocks of "
            f"{info.block_size} tokens)", "prompt")
    if not info.enable_chunked_prefill and len(token_ids) > info.max_num_batched_tokens:
        raise InvalidRequestError(
            f"prompt of {len(token_ids)} tokens exceeds max_num_batched_tokens={info.max_num_batched_tokens} "
            f"and chunked prefill is off", "prompt")
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be <= {MAX_LOGPROBS}, got {params.logprobs}", "logprobs")
    if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {params.prompt_logprobs}",
                                  "prompt_logprobs")
    if not (isinstance(priority, int) and INT64_MIN <= priority <= INT64_MAX):
        raise InvalidRequestError("priority must fit in a signed 64-bit int", "priority")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(params.stop_token_ids)}",
                                  "stop_token_ids")
    if not _all_token_ids(params.stop_token_ids, info.vocab_size):
        raise InvalidRequestError(f"stop_token_ids must be integers in [0, {info.vocab_size})", "stop_token_ids")
    if params.n != 1:
        raise InvalidRequestError("an engine runs one sequence per request: the frontend fans n out", "n")
    if params.logit_bias and not _all_token_ids(list(params.logit_bias), info.vocab_size):
        raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {info.vocab_size})", "logit_bias")
    if params.resumed_output_tokens >= len(token_ids):
        raise InvalidRequestError("resumed_output_tokens must be fewer than the prompt's tokens", "prompt")
    if not _all_token_ids(token_ids, info.vocab_size):
        raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {info.vocab_size})", "prompt")


def _all_token_ids(ids: list[int], vocab_size: int) -> bool:
    # NOTE: `bool` is an int subclass; a JSON `true` in a token list is a client bug, not token 1.
    return all(type(t) is int and 0 <= t < vocab_size for t in ids)
