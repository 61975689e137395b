"""The engine: one worker's step loop tying scheduler, model runner and output processing."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvbaton.config import ConfigError, EngineConfig, ModelConfig
from kvbaton.engine.kv_cache_manager import KVCacheManager, cdiv
from kvbaton.engine.model_runner import ModelRunner, kv_bytes_per_block
from kvbaton.engine.output_processor import OutputProcessor
from kvbaton.engine.request import Request, RequestStatus
from kvbaton.engine.request_output import RequestOutput
from kvbaton.engine.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.engine.scheduler import Scheduler
from kvbaton.engine.tokenizer import Tokenizer
from kvbaton.models.loader import load_model
from kvbaton.models.registry import resolve_model

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict
MAX_LOGPROBS = 20  # as vLLM's default `max_logprobs`


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_slots_allocated: int
    kv_slots_filled: int
    prefix_cache_hit_rate: float
    num_preemptions: int

    @property
    def kv_waste_fraction(self) -> float:
        """Allocated-but-unused slots over allocated slots (internal fragmentation)."""
        if not self.kv_slots_allocated:
            return 0.0
        return 1.0 - self.kv_slots_filled / self.kv_slots_allocated


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        # NOTE: without native bf16 (AVX512-BF16/AMX), bf16 GEMMs are emulated and several
        # times slower than fp32 for batches, so "auto" picks fp32 there.
        capability = torch.backends.cpu.get_cpu_capability()
        return torch.bfloat16 if capability in ("AVX512", "AVX512_BF16", "AMX") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.model_dir = model_dir
        self.dtype = resolve_dtype(config.dtype)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.tokenizer = Tokenizer(model_dir)
        model = load_model(model_dir, self.dtype, self.max_model_len)
        self.block_size = config.cache.block_size
        block_bytes = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        self.num_blocks = config.cache.num_blocks or max(1, int(config.cache.kv_cache_memory_gb * 2**30 // block_bytes))
        self.kv_cache = KVCacheManager(self.num_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.eos_token_ids = self._eos_token_ids()
        self.runner = ModelRunner(model, self.num_blocks, self.block_size, self.dtype, config.seed,
                                  self.eos_token_ids)
        if config.compile:
            from kvbaton.engine.compile import compile_model

            compile_model(self.runner)
        self.outputs = OutputProcessor(self.tokenizer)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError and changes nothing if bad."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        req = Request(request_id, token_ids, params, self.eos_token_ids, priority,
                      arrival_time if arrival_time is not None else time.monotonic())
        self.scheduler.add_request(req)
        self.outputs.add_request(request_id, text, token_ids, params, req.arrival_time)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [out for out in map(self.outputs.abort, ids) if out is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        model_output = self.runner.execute(sched)
        results = []
        for core_output in self.scheduler.update_from_output(sched, model_output):
            out, stop_string = self.outputs.process(core_output)
            if stop_string is not None and core_output.finish_reason is None:
                self.scheduler.finish_requests([core_output.request_id], RequestStatus.FINISHED_STOPPED)
            results.append(out)
        return results

    def stats(self) -> EngineStats:
        allocated, filled = self.kv_cache.slot_waste(self.scheduler.running)
        return EngineStats(
            self.scheduler.num_running, self.scheduler.num_waiting, self.kv_cache.usage(), allocated, filled,
            self.kv_cache.prefix_cache_stats().hit_rate, self.scheduler.num_preemptions,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ---- internals -------------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequestError("prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequestError(f"prompt must be a string, a token id list or a dict, not {type(prompt).__name__}")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be <= {MAX_LOGPROBS}, got {params.logprobs}")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but the model's context length is {self.max_model_len}; "
                f"it must be shorter to leave room for at least one generated token")
        if cdiv(len(token_ids) + 1, self.block_size) > self.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens cannot fit in the KV cache ({self.num_blocks} blocks of "
                f"{self.block_size} tokens)")
        budget = self.config.scheduler.max_num_batched_tokens
        if not self.config.scheduler.enable_chunked_prefill and len(token_ids) > budget:
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens exceeds max_num_batched_tokens={budget} "
                f"and chunked prefill is off")

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


__all__ = ["LLMEngine", "EngineStats", "ConfigError", "InvalidRequestError"]
