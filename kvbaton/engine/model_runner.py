"""Run one scheduled step on the model: build the flattened batch, forward, sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbaton.config import ModelConfig
from kvbaton.engine.outputs import ModelOutput, ScheduledRequest, SchedulerOutput
from kvbaton.layers.attention import AttentionMetadata, PrefillSpan
from kvbaton.layers.sampler import SamplingRow, sample
from kvbaton.models.llama import KVCache, LlamaForCausalLM


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer: the memory one block costs."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> list[KVCache]:
    shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(cfg.num_hidden_layers)]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows whose next token is sampled
    sampled: list[ScheduledRequest]  # in the order of `logits_indices`


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype)
        self._generators: dict[str, torch.Generator] = {}
        self._seed = seed

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        for request_id in sched.finished_request_ids:
            self._generators.pop(request_id, None)
        if sched.is_empty:
            return ModelOutput({})
        inputs = self.prepare_inputs(sched.scheduled)
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            inputs.logits_indices)
        rows = [SamplingRow(s.request_id, s.sampling_params, self._generator(s)) for s in inputs.sampled]
        tokens, logprobs = sample(logits, rows)
        return ModelOutput(
            {s.request_id: t for s, t in zip(inputs.sampled, tokens)},
            {s.request_id: lp for s, lp in zip(inputs.sampled, logprobs) if lp is not None},
        )

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        # NOTE: single-token chunks (decodes) go first and share one batched attention call.
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        ordered = decodes + prefills
        input_ids = torch.tensor([t for s in ordered for t in s.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s.start_position, s.start_position + s.num_tokens) for s in ordered])
        slot_mapping = torch.cat([self._slots(s, s.start_position, s.start_position + s.num_tokens)
                                  for s in ordered])
        decode_slots, decode_mask = self._decode_context(decodes)
        spans, offset = [], len(decodes)
        for s in prefills:
            spans.append(self._prefill_span(s, offset))
            offset += s.num_tokens
        ends = torch.tensor([s.num_tokens for s in ordered]).cumsum(0) - 1
        sample_rows = [i for i, s in enumerate(ordered) if s.sample]
        meta = AttentionMetadata(slot_mapping, len(decodes), decode_slots, decode_mask, tuple(spans))
        return StepInputs(input_ids, positions, meta, ends[sample_rows], [ordered[i] for i in sample_rows])

    def _block_table(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long)

    def _slots(self, s: ScheduledRequest, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = self._block_table(s.block_ids)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _decode_context(self, decodes: list[ScheduledRequest]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not decodes:
            return None, None
        context_lens = torch.tensor([s.start_position + 1 for s in decodes])  # [B]
        max_blocks = max(len(s.block_ids) for s in decodes)
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, s in enumerate(decodes):
            table[i, : len(s.block_ids)] = self._block_table(s.block_ids)
        offsets = torch.arange(self.block_size)
        slots = (table.unsqueeze(-1) * self.block_size + offsets).flatten(1)  # [B, max_blocks * bs]
        max_len = int(context_lens.max())
        slots = slots[:, :max_len]
        mask = torch.arange(max_len).unsqueeze(0) < context_lens.unsqueeze(1)  # [B, Lmax]
        return slots, mask[:, None, None, :]

    def _prefill_span(self, s: ScheduledRequest, query_start: int) -> PrefillSpan:
        if s.start_position == 0:
            return PrefillSpan(query_start, s.num_tokens, None, None)
        context_len = s.start_position + s.num_tokens
        q_pos = torch.arange(s.start_position, context_len).unsqueeze(1)  # [Lq, 1]
        mask = torch.arange(context_len).unsqueeze(0) <= q_pos  # [Lq, L] bottom-right causal
        return PrefillSpan(query_start, s.num_tokens, self._slots(s, 0, context_len), mask)

    def _generator(self, s: ScheduledRequest) -> torch.Generator:
        gen = self._generators.get(s.request_id)
        if gen is None:
            gen = torch.Generator()
            seed = s.sampling_params.seed
            # NOTE: unseeded requests still get their own stream, derived from the engine seed.
            gen.manual_seed(seed if seed is not None else hash((self._seed, s.request_id)) & (2**63 - 1))
            self._generators[s.request_id] = gen
        return gen
