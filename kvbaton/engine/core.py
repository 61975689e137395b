"""The engine core: scheduler + model runner over one paged KV pool. It knows token ids,
never text, so the same core runs in-process (`LLMEngine`) or as a worker process driven
over ZeroMQ (`kvbaton.engine.core_proc`)."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.engine.kv_cache_manager import KVCacheManager, cdiv
from kvbaton.engine.model_runner import KVAllocator, ModelRunner, kv_bytes_per_block
from kvbaton.engine.outputs import EngineCoreOutput
from kvbaton.engine.request import Request, RequestStatus
from kvbaton.engine.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.engine.scheduler import Scheduler
from kvbaton.layers.compute_paths import set_compute_paths
from kvbaton.models.loader import load_model

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # as vLLM's default `max_logprobs`
# NOTE: measured on a 2-core AVX2 EPYC: an (emulated) bf16 GEMM loses to fp32 from ~16 rows on.
UPCAST_MIN_ROWS = 16
# bf16 models up to this size also keep an fp32 copy of their weights for many-row steps.
FP32_WEIGHT_COPY_MAX_BYTES = 2**30


def resolve_dtype(name: str) -> torch.dtype:
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def has_native_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class EngineInfo:
    """What a frontend needs to validate requests without asking the core."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_slots_allocated: int
    kv_slots_filled: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int

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


def validate_request(info: EngineInfo, token_ids: list[int], params: SamplingParams) -> None:
    """Raise InvalidRequestError (naming the problem) for a request the core cannot run."""
    if not token_ids:
        raise InvalidRequestError("prompt is empty")
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be <= {MAX_LOGPROBS}, got {params.logprobs}")
    if not all(isinstance(t, int) and 0 <= t < info.vocab_size for t in token_ids):
        raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {info.vocab_size})")
    if len(token_ids) >= info.max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(token_ids)} tokens but the model's context length is {info.max_model_len}; "
            f"it must be shorter to leave room for at least one generated token")
    if cdiv(len(token_ids) + 1, info.block_size) > info.num_blocks:
        raise InvalidRequestError(
            f"prompt of {len(token_ids)} tokens cannot fit in the KV cache ({info.num_blocks} blocks of "
            f"{info.block_size} tokens)")
    if not info.enable_chunked_prefill and len(token_ids) > info.max_num_batched_tokens:
        raise InvalidRequestError(
            f"prompt of {len(token_ids)} tokens exceeds max_num_batched_tokens={info.max_num_batched_tokens} "
            f"and chunked prefill is off")


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path, eos_token_ids: tuple[int, ...],
                 kv_allocator: KVAllocator | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(config.dtype)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        limit = self.model_config.max_position_embeddings
        max_model_len = min(config.max_model_len or limit, limit)
        model = load_model(model_dir, self.dtype, max_model_len)
        if self.dtype == torch.bfloat16 and not has_native_bf16():
            # NOTE: emulated bf16: many rows compute in fp32, a few rows stream bf16 weights in C.
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            set_compute_paths(model, UPCAST_MIN_ROWS, config.kernels,
                              keep_fp32_weights=weight_bytes <= FP32_WEIGHT_COPY_MAX_BYTES)
        block_size = config.cache.block_size
        block_bytes = kv_bytes_per_block(self.model_config, block_size, self.dtype)
        num_blocks = config.cache.num_blocks or max(1, int(config.cache.kv_cache_memory_gb * 2**30 // block_bytes))
        self.info = EngineInfo(max_model_len, self.model_config.vocab_size, num_blocks, block_size,
                               config.scheduler.max_num_batched_tokens, config.scheduler.enable_chunked_prefill,
                               eos_token_ids)
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, max_model_len)
        self.runner = ModelRunner(model, num_blocks, block_size, self.dtype, config.seed, eos_token_ids,
                                  use_kernels=config.kernels, kv_allocator=kv_allocator)
        if config.compile:
            from kvbaton.engine.compile import compile_model

            compile_model(self.runner)
        # NOTE: everything allocated so far (modules, weights, tokenizer tables) lives as long as the
        # engine: move it out of the cyclic GC's sight, or every collection walks it again
        # (measured: ~1/4 of a batch-1 decode step on the default model).
        gc.collect()
        gc.freeze()

    def validate(self, req: Request) -> None:
        validate_request(self.info, req.prompt_token_ids, req.sampling_params)

    def add_request(self, req: Request) -> None:
        self.validate(req)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        model_output = self.runner.execute(sched)
        return self.scheduler.update_from_output(sched, model_output)

    def stats(self) -> EngineStats:
        allocated, filled = self.kv_cache.slot_waste(self.scheduler.running)
        prefix = self.kv_cache.prefix_cache_stats()
        return EngineStats(
            self.scheduler.num_running, self.scheduler.num_waiting, self.kv_cache.usage(), allocated, filled,
            prefix.queried_tokens, prefix.hit_tokens, self.scheduler.num_preemptions,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
