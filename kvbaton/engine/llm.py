"""Offline batch API in vLLM's shape: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from kvbaton.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.engine.engine import LLMEngine
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.inputs import PromptType, tokenize_prompt
from kvbaton.text.request_output import RequestOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import TypeIs

_CACHE_FIELDS = {f.name for f in fields(CacheConfig)}
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}


class LLM:
    """Keyword arguments are vLLM's where they exist (`max_model_len`, `block_size`,
    `enable_prefix_caching`, `max_num_seqs`, `max_num_batched_tokens`, ...)."""

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        cache = CacheConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS})
        scheduler = SchedulerConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in _SCHEDULER_FIELDS})
        self.engine = LLMEngine(EngineConfig(model=model, cache=cache, scheduler=scheduler, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer.hf

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the order of `prompts`.

        All prompts are validated before any runs, so one bad prompt raises and costs nothing.
        """
        prompts = self._as_list(prompts)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        params = sampling_params
        if len(params) != len(prompts):
            raise ValueError("sampling_params list must match the prompts in length")
        priorities = priority or [0] * len(prompts)
        for prompt, p in zip(prompts, params):
            self.engine.validate(tokenize_prompt(self.engine.tokenizer, prompt)[1], _sample(p, 0))
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p, prio in zip(ids, prompts, params, priorities):
            for j in range(p.n):  # n samples: n requests, their prompt's blocks shared through the prefix cache
                self.engine.add_request(_child_id(request_id, j, p.n), prompt, _sample(p, j), prio)
        finished = self._run([_child_id(i, j, p.n) for i, p in zip(ids, params) for j in range(p.n)], use_tqdm)
        return [_merged(request_id, [finished[_child_id(request_id, j, p.n)] for j in range(p.n)])
                for request_id, p in zip(ids, params)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = messages if _is_batch(messages) else [messages]
        prompts: list[PromptType] = [{"prompt_token_ids": self.engine.tokenizer.encode(
            self.engine.tokenizer.apply_chat_template(c)), "prompt": None} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="generate", unit="req")
        group = self.engine.core.expert_parallel
        if group is not None:  # every rank of an EP group calls generate (maybe with no prompts): step together
            group.expect_work()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return finished

    @staticmethod
    def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if _is_token_ids(prompts):
            return [{"prompt_token_ids": prompts}]
        return list(prompts)


def _child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


def _sample(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of n: one sequence, seeded seed + index (so the samples differ and repeat run to run)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
    return dataclasses.replace(params, n=1, seed=seed)


def _merged(request_id: str, samples: list[RequestOutput]) -> RequestOutput:
    """n samples of one prompt as one output with n completions, as vLLM's `LLM` returns them."""
    if len(samples) == 1:
        return samples[0]
    completions = [dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)]
    return dataclasses.replace(samples[0], request_id=request_id, outputs=completions)


def _is_batch(messages: list[dict] | list[list[dict]]) -> TypeIs[list[list[dict]]]:
    """Several conversations rather than one conversation's messages."""
    return bool(messages) and isinstance(messages[0], list)


def _is_token_ids(prompts: list[int] | Sequence[PromptType]) -> TypeIs[list[int]]:
    """One prompt given as token ids rather than a list of prompts."""
    return bool(prompts) and all(isinstance(t, int) for t in prompts)
