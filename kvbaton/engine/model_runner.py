"""Run one scheduled step on the model: build the flattened batch, forward, sample."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from kvbaton.config import ConfigError
from kvbaton.engine.sampler import SamplingRow, greedy_tokens, sample, token_logprobs
from kvbaton.engine.structured.matchers import GrammarMatchers
from kvbaton.kernels import PagedDecodeKernel, PagedPrefillKernel, paged_decode_kernel, paged_prefill_kernel
from kvbaton.kv.connectors.base import KVSender, TransferSpec
from kvbaton.kv.pools import KVPools, torch_dtype
from kvbaton.layers.attention import AttentionMetadata, PrefillSpan
from kvbaton.mm.mrope import MropePositions
from kvbaton.models.families import CausalLM
from kvbaton.models.layer_loop import build_layer_loop
from kvbaton.platform.compute import AttentionCode
from kvbaton.sched.outputs import ModelOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs, TransferFailure


def _derived_seed(engine_seed: int, request_id: str) -> int:
    """Stable across processes (unlike `hash()`), so the engine seed makes runs repeatable."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S + P] rows whose next token is sampled, then rows of prompt logprobs
    sampled: list[ScheduledRequest]  # in the order of the first S `logits_indices`
    # (chunk, its first row among the last P) of each chunk that predicts prompt tokens
    prompt_logprob_rows: list[tuple[ScheduledRequest, int]] = dataclasses.field(default_factory=list)
    # (rows [R], embeddings [R, E]): the rows of image placeholders and what stands in for their tokens
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, pools: KVPools, seed: int = 0, eos_token_ids: tuple[int, ...] = (),
                 attention: AttentionCode = "c", kv_sender: KVSender | None = None) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.pools = pools
        self.kv_caches = pools.caches
        layout = pools.layout
        self.block_size = layout.block_size
        self.dtype = next(model.parameters()).dtype  # what the model computes in (a quantized pool holds bytes)
        # c-per-token (deterministic): every token, prefill ones too, attends as a decode query over its
        # unsplit context, so its sums never depend on the batch, the chunking or the thread count.
        self.per_token_attention = attention == "c-per-token"
        self.decode_kernel, self.prefill_kernel = self._attention_kernels(model.config.num_attention_heads, attention)
        # decode steps without per-layer Python, where the model and the plan allow it (the C layer loop)
        model.layer_loop = build_layer_loop(model, self.kv_caches, self.block_size, self.decode_kernel)
        self._generators: dict[str, torch.Generator] = {}
        self._seed = seed
        self.kv_sender = kv_sender  # prefill role: each layer's KV goes out as soon as it is computed
        self.grammars: GrammarMatchers | None = None  # set by the core with the first structured request
        # per request with images: (prompt position of an image's first placeholder, its embeddings [n, E]),
        # kept until the request ends (a preempted request computes its prompt again; the core drops them)
        self.image_embeddings: dict[str, list[tuple[int, torch.Tensor]]] = {}
        # per request with images of a multimodal-RoPE model (Qwen2-VL): its positions, as long as it lives
        self.mrope: dict[str, MropePositions] = {}

    def _attention_kernels(self, num_heads: int, attention: AttentionCode,
                           ) -> tuple[PagedDecodeKernel | None, PagedPrefillKernel | None]:
        """The C attention kernels the compute plan names, for this pool (None: PyTorch's path)."""
        layout = self.pools.layout
        if layout.is_mla:  # NOTE: the C kernels read per-head K/V rows; latent attention is PyTorch's (layers.mla)
            if self.per_token_attention:
                raise ConfigError("--deterministic needs the C decode-attention kernel, which does not take multi-head "
                                  "latent attention's KV layout")
            return None, None
        dtype = torch_dtype(layout)  # the pool's storage: the kernels read its format from it
        shape = (num_heads, layout.num_kv_heads, layout.head_dim)
        decode = (paged_decode_kernel(dtype, *shape, split_context=not self.per_token_attention)
                  if attention != "torch" else None)
        prefill = paged_prefill_kernel(dtype, *shape) if attention == "c" else None  # c+sdpa: SDPA
        if self.per_token_attention and decode is None:
            raise ConfigError(f"--deterministic needs the C decode-attention kernel, which does not take this model's "
                              f"(heads, kv heads, head dim) = {shape}")
        return decode, prefill

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        for request_id in sched.finished_request_ids:
            self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.drop(sched.finished_request_ids)
        if sched.is_empty:
            return ModelOutput({})
        if sched.decode_steps > 1:
            return self._decode_burst(sched.scheduled, sched.decode_steps)
        inputs = self.prepare_inputs(sched.scheduled)
        meta = inputs.meta
        outgoing, failed = self._begin_transfers(sched.scheduled)
        if outgoing:
            sender = self.kv_sender
            assert sender is not None
            meta = dataclasses.replace(meta, after_layer=lambda layer: sender.save_layer(layer, outgoing))
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, inputs.logits_indices,
                            image_rows=inputs.image_rows)
        prompt_logprobs = self._prompt_logprobs(logits[len(inputs.sampled):], inputs.prompt_logprob_rows)
        logits = logits[: len(inputs.sampled)]
        rows = [SamplingRow(s.request_id, s.sampling_params, self._generator(s), self._banned(s),
                            s.prompt_token_ids if s.sampling_params.repetition_penalty != 1.0 else (),
                            s.generated_token_ids if s.sampling_params.has_penalties else ())
                for s in inputs.sampled]
        tokens, logprobs = sample(logits, rows, self._grammar_mask(inputs.sampled),
                                  fallback_token=self.eos_token_ids[0] if self.eos_token_ids else 0)
        return ModelOutput(
            {s.request_id: [t] for s, t in zip(inputs.sampled, tokens)},
            {s.request_id: lp for s, lp in zip(inputs.sampled, logprobs) if lp is not None},
            failed, prompt_logprobs,
        )

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple[ScheduledRequest, int]],
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Each chunk's rows predict the prompt tokens after them: their logprobs, from the model's logits."""
        out = {}
        for s, first in rows:
            n = s.num_prompt_logprob_rows
            targets = list(s.prompt_token_ids[s.start_position + 1: s.start_position + 1 + n])
            out[s.request_id] = (s.start_position, token_logprobs(logits[first: first + n].float(), targets,
                                                                  [s.prompt_logprobs or 0] * n))
        return out

    def _begin_transfers(self, scheduled: list[ScheduledRequest]) -> tuple[list[str], list[TransferFailure]]:
        """Prefill role: register the KV hand-off of every request whose prompt ends this step, so each
        layer can go out as soon as it is computed. Returns (begun request ids, refusals)."""
        started: list[str] = []
        failed: list[TransferFailure] = []
        for s in scheduled:
            remote = s.remote_decode
            if remote is None:
                continue
            spec = TransferSpec(request_id=s.request_id, src_block_ids=s.block_ids[remote.skip_blocks:],
                                dst_block_ids=list(remote.dst_block_ids), receiver=remote.receiver,
                                layout=remote.layout, deadline_s=remote.deadline_s)
            try:
                if self.kv_sender is None:
                    raise RuntimeError("this worker has no KV sender (not started in the prefill role)")
                if len(spec.src_block_ids) != len(spec.dst_block_ids):
                    raise ValueError(f"{len(spec.src_block_ids)} blocks to send but {len(spec.dst_block_ids)} "
                                     "reserved by the receiver")
                self.kv_sender.begin(spec)
                started.append(s.request_id)
            except (ValueError, RuntimeError) as exc:
                failed.append(TransferFailure(s.request_id, str(exc)))
        return started, failed

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        if all(s.num_tokens == 1 and s.sample and not s.num_prompt_logprob_rows for s in scheduled) and not (
                self.image_embeddings and any(self._images_in(s) for s in scheduled)):
            return self._decode_inputs(scheduled)
        # NOTE: single-token chunks (decodes) go first and share one batched attention call.
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        ordered = decodes + prefills
        input_ids = torch.tensor([t for s in ordered for t in s.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s.start_position, s.start_position + s.num_tokens) for s in ordered])
        if self.mrope and any(s.request_id in self.mrope for s in ordered):
            positions = self._mrope_positions(ordered, positions)
        slot_mapping = torch.cat([self._slots(s, s.start_position, s.start_position + s.num_tokens)
                                  for s in ordered])
        ends = torch.tensor([s.num_tokens for s in ordered]).cumsum(0) - 1
        sample_rows = [i for i, s in enumerate(ordered) if s.sample]
        extra, prompt_rows = self._prompt_logprob_indices(ordered, ends)
        if self.per_token_attention:
            table, context_lens = self._per_token_context(ordered)
            meta = AttentionMetadata(self.block_size, slot_mapping, len(input_ids), table, context_lens, None, (),
                                     self.decode_kernel, None)
        else:
            decode_table, decode_lens, decode_mask = self._decode_context(decodes)
            spans, offset = [], len(decodes)
            for s in prefills:
                spans.append(self._prefill_span(s, offset))
                offset += s.num_tokens
            meta = AttentionMetadata(self.block_size, slot_mapping, len(decodes), decode_table, decode_lens,
                                     decode_mask, tuple(spans), self.decode_kernel, self.prefill_kernel)
        indices = ends[sample_rows] if not extra else torch.cat([ends[sample_rows], torch.tensor(extra)])
        return StepInputs(input_ids, positions, meta, indices, [ordered[i] for i in sample_rows], prompt_rows,
                          self._image_rows(ordered) if self.image_embeddings else None)

    def _mrope_positions(self, ordered: list[ScheduledRequest], positions: torch.Tensor) -> torch.Tensor:
        """The step's RoPE positions with its multimodal-RoPE requests': [3, T] (t, row, column) while an image's
        placeholders are in the step, else [T] (text: every axis alike, behind its index by the request's delta)."""
        out = positions.unsqueeze(0).repeat(3, 1)
        offset = 0
        for s in ordered:
            mrope = self.mrope.get(s.request_id)
            if mrope is not None:
                out[:, offset:offset + s.num_tokens] = mrope.of(s.start_position, s.start_position + s.num_tokens)
            offset += s.num_tokens
        return out[0] if bool((out == out[0]).all()) else out

    def _images_in(self, s: ScheduledRequest) -> list[tuple[int, int, torch.Tensor]]:
        """(first, end, embeddings of positions first..end) of each image placeholder run in `s`'s chunk."""
        start, end = s.start_position, s.start_position + s.num_tokens
        return [(max(p, start), min(p + e.shape[0], end), e[max(p, start) - p: min(p + e.shape[0], end) - p])
                for p, e in self.image_embeddings.get(s.request_id, ()) if p < end and start < p + e.shape[0]]

    def _image_rows(self, ordered: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows, values, offset = [], [], 0
        for s in ordered:
            for first, end, embeddings in self._images_in(s):
                rows.append(torch.arange(offset + first - s.start_position, offset + end - s.start_position))
                values.append(embeddings)
            offset += s.num_tokens
        return (torch.cat(rows), torch.cat(values)) if rows else None

    def _decode_burst(self, decodes: list[ScheduledRequest], steps: int) -> ModelOutput:
        """`steps` decode steps of the same requests back to back, each step's argmax the next one's input
        (sched/burst.py: every request decodes greedily with nothing else to sample by). The scheduler took their
        slots."""
        tokens = [s.token_ids[0] for s in decodes]
        loop = self.model.layer_loop
        # the whole burst in one C call (over this runner's pools), unless a request's RoPE runs behind its index
        if loop is not None and loop.bursts(len(decodes)) and not (
                self.mrope and any(s.request_id in self.mrope for s in decodes)):
            _, table = self._decode_table(decodes, [s.start_position + steps - 1 for s in decodes])
            out = loop.burst(torch.tensor(tokens, dtype=torch.long),
                             torch.tensor([s.start_position for s in decodes], dtype=torch.long), table, steps)
            return ModelOutput({s.request_id: row for s, row in zip(decodes, out.tolist())})
        sampled: list[list[int]] = [[] for _ in decodes]
        for step in range(steps):
            inputs = self._decode_inputs(decodes, step, tokens)
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                inputs.logits_indices)
            tokens = greedy_tokens(logits)
            for row, token in zip(sampled, tokens):
                row.append(token)
        return ModelOutput({s.request_id: out for s, out in zip(decodes, sampled)})

    def _decode_inputs(self, decodes: list[ScheduledRequest], ahead: int = 0,
                       token_ids: list[int] | None = None) -> StepInputs:
        """A step of decodes only (the common one): its tensors built from plain lists, one `torch.tensor` each
        (~20 us for one request, where the general path's per-request tensor ops took ~100 us). Same values as
        the general path. A burst's later steps are `ahead` positions further, with their own `token_ids`."""
        bs = self.block_size
        positions = [s.start_position + ahead for s in decodes]
        tables, table = self._decode_table(decodes, positions)
        slots = [ids[p // bs] * bs + p % bs for ids, p in zip(tables, positions)]
        width = table.shape[1]
        context_lens = torch.tensor([p + 1 for p in positions], dtype=torch.long)
        mask = None if self.decode_kernel is not None else self._decode_mask(context_lens, width)
        meta = AttentionMetadata(bs, torch.tensor(slots, dtype=torch.long), len(decodes), table, context_lens, mask,
                                 (), self.decode_kernel, None)
        if token_ids is None:
            token_ids = [s.token_ids[0] for s in decodes]
        if self.mrope:  # text after images: RoPE's position runs behind the index by the request's delta
            deltas = [m.delta if (m := self.mrope.get(s.request_id)) else 0 for s in decodes]
            positions = [p + d for p, d in zip(positions, deltas)]
        return StepInputs(torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta,
                          torch.arange(len(decodes)), decodes)

    def _decode_table(self, decodes: list[ScheduledRequest], last_positions: list[int],
                      ) -> tuple[list[list[int]], torch.Tensor]:
        """Each decode's blocks up to the one holding its `last_positions` entry, and them as one [B, nb] table
        (0-padded to the widest)."""
        bs = self.block_size
        tables = [s.block_ids[: p // bs + 1] for s, p in zip(decodes, last_positions)]
        width = max(len(t) for t in tables)
        return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)

    def _decode_mask(self, context_lens: torch.Tensor, max_blocks: int) -> torch.Tensor:
        """The PyTorch decode path's additive mask: [B, 1, 1, nb * block_size], -inf past each context."""
        visible = torch.arange(max_blocks * self.block_size).unsqueeze(0) < context_lens.unsqueeze(1)  # [B, L]
        mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        return mask[:, None, None, :]

    @staticmethod
    def _prompt_logprob_indices(ordered: list[ScheduledRequest], ends: torch.Tensor,
                                ) -> tuple[list[int], list[tuple[ScheduledRequest, int]]]:
        """Flattened rows of the tokens whose logits give prompt logprobs (they follow the sampled rows), and
        where each chunk's rows start among them."""
        extra: list[int] = []
        rows = []
        for i, s in enumerate(ordered):
            n = s.num_prompt_logprob_rows
            if n:
                start = int(ends[i]) - s.num_tokens + 1  # the chunk's first flattened row
                rows.append((s, len(extra)))
                extra.extend(range(start, start + n))
        return extra, rows

    def _per_token_context(self, ordered: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token as a decode query: [T, nb] block table (its request's blocks) and [T] context
        lengths (its position + 1: causal by construction)."""
        context_lens = torch.cat([torch.arange(s.start_position + 1, s.start_position + s.num_tokens + 1)
                                  for s in ordered])
        max_blocks = max(self._num_blocks(s.start_position + s.num_tokens) for s in ordered)
        table = torch.zeros(len(context_lens), max_blocks, dtype=torch.long)
        row = 0
        for s in ordered:
            ids = self._block_table(s.block_ids[: self._num_blocks(s.start_position + s.num_tokens)])
            table[row: row + s.num_tokens, : len(ids)] = ids
            row += s.num_tokens
        return table, context_lens

    def _block_table(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long)

    def _slots(self, s: ScheduledRequest, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = self._block_table(s.block_ids)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _decode_context(self, decodes: list[ScheduledRequest]) -> tuple[torch.Tensor | None, ...]:
        """Block table and context lengths of the decodes; the PyTorch path also needs a mask."""
        if not decodes:
            return None, None, None
        context_lens = torch.tensor([s.start_position + 1 for s in decodes])  # [B]
        max_blocks = max(self._num_blocks(s.start_position + 1) for s in decodes)
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)  # [B, nb]
        for i, s in enumerate(decodes):
            ids = s.block_ids[: self._num_blocks(s.start_position + 1)]
            table[i, : len(ids)] = self._block_table(ids)
        if self.decode_kernel is not None:
            return table, context_lens, None
        return table, context_lens, self._decode_mask(context_lens, max_blocks)

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefill_span(self, s: ScheduledRequest, query_start: int) -> PrefillSpan:
        context_len = s.start_position + s.num_tokens
        if self.prefill_kernel is not None:  # reads all K/V through the block table; causal by position
            blocks = self._block_table(s.block_ids[: self._num_blocks(context_len)])
            return PrefillSpan(query_start, s.num_tokens, blocks, context_len, None)
        if s.start_position == 0:
            return PrefillSpan(query_start, s.num_tokens, None, s.num_tokens, None)
        q_pos = torch.arange(s.start_position, context_len).unsqueeze(1)  # [Lq, 1]
        mask = torch.arange(context_len).unsqueeze(0) <= q_pos  # [Lq, L] bottom-right causal
        blocks = self._block_table(s.block_ids[: self._num_blocks(context_len)])
        return PrefillSpan(query_start, s.num_tokens, blocks, context_len, mask)

    def _grammar_mask(self, sampled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The token bitmask of the rows whose request follows a grammar (None: no such row)."""
        rows = [(i, s) for i, s in enumerate(sampled) if s.sampling_params.structured_output is not None]
        if not rows:
            return None
        if self.grammars is None:
            raise RuntimeError("a structured-output request reached the runner before its grammar was compiled")
        specs = [(s.request_id, s.sampling_params.structured_output, s.generated_token_ids) for _, s in rows]
        return self.grammars.bitmask(specs, [i for i, _ in rows])  # type: ignore[arg-type]

    def _banned(self, s: ScheduledRequest) -> tuple[int, ...]:
        """Until `min_tokens` are out, EOS and stop tokens cannot be sampled (as in vLLM)."""
        params = s.sampling_params
        if s.num_output_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(eos) + tuple(params.stop_token_ids)

    def _generator(self, s: ScheduledRequest) -> torch.Generator:
        gen = self._generators.get(s.request_id)
        if gen is None:
            gen = torch.Generator()
            seed = s.sampling_params.seed
            # NOTE: unseeded requests still get their own stream, derived from the engine seed.
            gen.manual_seed(seed if seed is not None else _derived_seed(self._seed, s.request_id))
            self._generators[s.request_id] = gen
        return gen
