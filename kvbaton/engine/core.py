"""The engine core: scheduler + model runner over one paged KV pool. It knows token ids,
never text, so the same core runs in-process (`LLMEngine`) or as a worker process driven
over ZeroMQ (`kvbaton.engine.core_proc`)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.engine.info import EngineInfo, EngineStats, validate_request
from kvbaton.engine.kv_cache_manager import KVCacheManager
from kvbaton.engine.model_runner import ModelRunner, kv_layout
from kvbaton.engine.outputs import EngineCoreOutput
from kvbaton.engine.request import Request, RequestStatus
from kvbaton.engine.scheduler import Scheduler
from kvbaton.kv.pools import PoolAllocator, allocate_pools
from kvbaton.layers.compute_paths import set_compute_paths
from kvbaton.models.loader import load_model

logger = logging.getLogger(__name__)

# NOTE: measured on a 2-core AVX2 EPYC: an (emulated) bf16 GEMM loses to fp32 from ~16 rows on.
UPCAST_MIN_ROWS = 16
# bf16 models up to this size also keep an fp32 copy of their weights for many-row steps.
FP32_WEIGHT_COPY_MAX_BYTES = 2**30


def resolve_dtype(name: str) -> torch.dtype:
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def has_native_bf16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path, eos_token_ids: tuple[int, ...],
                 kv_allocator: PoolAllocator = allocate_pools) -> None:
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
        self.kv_layout = kv_layout(self.model_config, block_size, self.dtype)
        num_blocks = config.cache.num_blocks or max(
            1, int(config.cache.kv_cache_memory_gb * 2**30 // self.kv_layout.bytes_per_block))
        self.info = EngineInfo(max_model_len=max_model_len, vocab_size=self.model_config.vocab_size,
                               num_blocks=num_blocks, block_size=block_size,
                               max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                               enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
                               eos_token_ids=eos_token_ids)
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, max_model_len)
        self.runner = ModelRunner(model, self.kv_layout, num_blocks, config.seed, eos_token_ids,
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
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_cache_usage=self.kv_cache.usage(), kv_slots_allocated=allocated, kv_slots_filled=filled,
                           prefix_cache_queried_tokens=prefix.queried_tokens, prefix_cache_hit_tokens=prefix.hit_tokens,
                           num_preemptions=self.scheduler.num_preemptions)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
