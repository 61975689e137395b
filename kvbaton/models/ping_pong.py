"""A decode step in micro-batches that take turns with the expert pool (attention/FFN disaggregation's
ping-pong): while the expert workers compute layer l of micro-batch i, this worker attends micro-batch i + 1.

    mb0: attend l0 ─post─┐            ┌─wait─ attend l1 ─post─┐            ┌─wait─ ...
    mb1:        attend l0 ─post─┐     │              attend l1 ─post─┐     │
    experts:             l0 mb0 ┴ l0 mb1      ...          l1 mb0 ┴ l1 mb1

Each micro-batch is a generator over the layers that yields once its MoE layer's rows are posted
(`SparseMoeBlock.begin`) and, resumed, takes their outputs (`end`) and goes on to the next layer; resuming the
micro-batches round-robin is the schedule above, for any count. Dense layers (and a MoE block whose experts are
here) run whole. A decode row attends only over its own context, so a micro-batch is a slice of the step's
rows with the slices of its metadata; the outputs are the rows of the unsplit step, whatever the count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence

import torch

from kvbaton.layers.attention import AttentionMetadata
from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.layers.rope import RotaryEmbedding

Rows = tuple[torch.Tensor, torch.Tensor]  # a micro-batch's (last layer's output, residual stream)


def splits(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """`rows` in min(rows, micro_batches) contiguous slices whose sizes differ by at most one."""
    count = max(1, min(rows, micro_batches))
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


def takes(meta: AttentionMetadata, rows: int, micro_batches: int) -> bool:
    """Whether a step splits: micro-batching asked for, and every row a decode query (no prefill, no KV hand-off
    watching layers)."""
    return micro_batches > 1 and rows > 1 and not meta.prefills and meta.num_decodes == rows \
        and meta.after_layer is None


def slice_meta(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """The metadata of rows [start, end) of a decode-only step."""
    def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:end]

    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping[start:end], num_decodes=end - start,
                               decode_block_table=rows_of(meta.decode_block_table),
                               decode_context_lens=rows_of(meta.decode_context_lens),
                               decode_mask=rows_of(meta.decode_mask))


def run_micro_batched(layers: Sequence[torch.nn.Module], rope: RotaryEmbedding, x: torch.Tensor,
                      positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                      micro_batches: int) -> Rows:
    """Every layer over a decode step's rows x [T, E], in ping-pong micro-batches; (output, residual) [T, E]."""
    turns = [_layers(layers, rope.cos_sin(positions[a:b]), x[a:b], kv_caches, slice_meta(meta, a, b))
             for a, b in splits(x.shape[0], micro_batches)]
    results: list[Rows | None] = [None] * len(turns)
    active = list(range(len(turns)))
    try:
        while active:
            for i in list(active):
                try:
                    next(turns[i])
                except StopIteration as done:
                    results[i] = done.value
                    active.remove(i)
    finally:
        for turn in turns:
            turn.close()
    outs = [r for r in results if r is not None]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _layers(layers: Sequence[torch.nn.Module], cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> Generator[None, None, Rows]:
    """One micro-batch's pass over the layers, yielding while each of its MoE exchanges is with the experts."""
    residual: torch.Tensor | None = None
    for layer, kv_cache in zip(layers, kv_caches):
        h, residual = layer.attend(cos_sin, x, residual, kv_cache, meta)  # type: ignore[operator]
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock) and mlp.dispatcher is not None:
            pending = mlp.begin(h)
            yield
            x = mlp.end(h, pending)
        else:
            x = mlp(h)  # type: ignore[operator]
    assert residual is not None, "the model has no layers"
    return x, residual
