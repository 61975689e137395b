"""What every decoder-only family shares around its layers: the embedding, the final norm, the LM head
(tied or not), and the step's forward over a paged KV pool. A family supplies its layers and RoPE."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kvbaton.config import ModelConfig
from kvbaton.layers.attention import AttentionMetadata
from kvbaton.layers.linear import Linear
from kvbaton.layers.norm import RMSNorm
from kvbaton.layers.rope import RotaryEmbedding
from kvbaton.models.ping_pong import run_micro_batched, takes

KVCache = torch.Tensor  # one layer's pool (its shape: the family's KV layout)


class LayerLoop(Protocol):
    """All layers of a step in one call (kvbaton.models.layer_loop: the C loop of decode steps)."""

    def runs(self, meta: AttentionMetadata, kv_caches: list[KVCache], rows: int) -> bool: ...

    @property
    def has_head(self) -> bool: ...  # whether `logits` runs the final norm and the lm_head too

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def bursts(self, rows: int) -> bool: ...  # whether `burst` takes a decode burst of this many rows

    def burst(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
              steps: int) -> torch.Tensor: ...  # a decode burst's tokens [T, steps] (kvbaton.sched.burst)


class DecoderStack(nn.Module):
    """`forward` takes a step's flattened tokens and returns logits only where asked. Each layer is called as
    `layer(cos_sin, x, residual, kv_cache, meta) -> (x, residual)`, the residual adds fused into its norms;
    a step the `layer_loop` takes (set by the runner) runs all layers in one call instead."""

    layer_loop: LayerLoop | None = None
    # an attention worker's (attention/FFN disaggregation): decode steps in this many ping-pong micro-batches
    micro_batches: int = 1

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.rope = rope
        # NOTE: given its (empty) weight, so no random init runs: on the meta device `normal_` imports
        # torch.compile's machinery (~2 s of a worker's start) to draw numbers the checkpoint replaces
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, E]
        if image_rows is not None:  # image placeholders: the encoder's embeddings stand in for their tokens
            x[image_rows[0]] = image_rows[1].to(x.dtype)
        loop = self.layer_loop
        residual: torch.Tensor | None = None
        by_axes = positions.dim() == 2  # (t, row, column): only the layers below rotate by sections (Qwen2-VL)
        if not by_axes and takes(meta, x.shape[0], self.micro_batches):  # the experts are elsewhere: take turns
            x, residual = run_micro_batched(list(self.layers), self.rope, x, positions, kv_caches, meta,
                                            self.micro_batches)
        elif not by_axes and loop is not None and loop.runs(meta, kv_caches, x.shape[0]):
            if loop.has_head and _every_row(logits_indices, x.shape[0]):
                return loop.logits(x, positions, meta)  # the head too, in the same C call
            residual = loop(x, positions, meta)  # x: the last layer's output, in place
        else:
            cos_sin = self.rope.cos_sin(positions)  # once per step, shared by all layers
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x, residual = layer(cos_sin, x, residual, kv_cache, meta)
                if meta.after_layer is not None:
                    meta.after_layer(i)
        assert residual is not None, "the model has no layers (or no KV caches)"
        x, _ = self.norm.add_forward(x[logits_indices], residual[logits_indices])  # [S, E]: only sampled rows
        return self.lm_head(x).float()  # [S, V]


def _every_row(logits_indices: torch.Tensor, rows: int) -> bool:
    """Whether a step samples each of its rows once, in order (every decode step does)."""
    if logits_indices.shape[0] != rows:
        return False
    return rows == 1 or bool(torch.equal(logits_indices, torch.arange(rows)))
