"""The C layer loop of decode steps (decode_layers.c): its spec structures and a tensor-level wrapper.

What a model's layers are made of is the model's business (kvbaton.models.layer_loop fills the specs);
this module only mirrors the C structures and calls the loop.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvbaton.kernels.build import cpu_kernels

# decode_layers.c's LIN_* kinds: which kernel computes a linear layer for a step's row count
LIN_NONE, LIN_DOT, LIN_STREAM, LIN_AMX, LIN_PACKED, LIN_PACKED_GATED = range(6)
LINEAR_OPTIONS = 3
KV_FORMATS = {torch.bfloat16: 2, torch.float32: 4}  # the pools the loop writes (vec8.h's KV_*)
MAX_HEAD_DIM = 256


# decode_layers.c's MoeExchange: (layer, rows, h, ids, weights, out) -> 0, or nonzero to fail the step
MOE_EXCHANGE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p)
EXCHANGE_FAILED = -7  # decode_layers.c: a MoE exchange failed midway


class LinearOption(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("isa", ctypes.c_int32), ("max_rows", ctypes.c_int64),
                ("weight", ctypes.c_void_p), ("weight_bytes", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("packed_n", ctypes.c_int64)]


class LinearSpec(ctypes.Structure):
    _fields_ = [("options", LinearOption * LINEAR_OPTIONS), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class LayerSpec(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", LinearSpec),
                ("o", LinearSpec), ("gate_up", LinearSpec), ("down", LinearSpec), ("kv_cache", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),  # per-head q/k norms' weights, or NULL
                # a MoE layer (router set): the gate's weight, the packed experts, the block's token counts
                ("router", ctypes.c_void_p), ("experts_gate_up", ctypes.c_void_p), ("experts_down", ctypes.c_void_p),
                ("expert_counts", ctypes.c_void_p)]


class StackSpec(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64),
                ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("block_size", ctypes.c_int32),
                ("kv_format", ctypes.c_int32), ("num_threads", ctypes.c_int32), ("allow_split", ctypes.c_int32),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("max_positions", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("final_norm", ctypes.c_void_p), ("lm_head", LinearSpec),  # lm_head.n == 0: no head
                # the MoE layers' shapes and kernels (num_experts 0: none; route_max_rows 0: every count)
                ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("moe_intermediate", ctypes.c_int64),
                ("route_max_rows", ctypes.c_int64), ("norm_topk", ctypes.c_int32), ("route_isa", ctypes.c_int32),
                ("experts_isa", ctypes.c_int32), ("amx_min_rows", ctypes.c_int32),
                ("exchange", MOE_EXCHANGE)]  # NULL: local experts


@dataclass(frozen=True)
class KernelChoice:
    """One way to compute a linear: a LIN_* kind over `weight` (the original or a packed copy)."""

    kind: int
    weight: torch.Tensor
    max_rows: int | None  # None: every row count
    bias: torch.Tensor | None = None  # fp32
    isa: int = 0
    packed_n: int = 0


class DecodeLayers:
    """Every layer of a step whose tokens all attend as decode queries, in one C call. Holds the tensors its
    specs point into, so they outlive it."""

    def __init__(self, lib: ctypes.CDLL, stack: StackSpec, layers: list[LayerSpec], keep: list[torch.Tensor]) -> None:
        self._run, self._take = lib.kvbaton_decode_layers, lib.kvbaton_decode_layers_take
        self._burst = lib.kvbaton_decode_burst
        self._workspace_bytes = lib.kvbaton_decode_layers_workspace
        self.stack = stack
        self.layers = (LayerSpec * len(layers))(*layers)
        self._stack_ref, self._layers_ref = ctypes.addressof(stack), ctypes.addressof(self.layers)
        self._keep = keep
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._takes: dict[int, bool] = {}

    def takes(self, rows: int) -> bool:
        """Whether every layer has a C kernel for this many rows (else the Python loop runs the step)."""
        known = self._takes.get(rows)
        if known is None:
            known = self._takes[rows] = bool(self._take(self._stack_ref, self._layers_ref, rows))
        return known

    @property
    def has_head(self) -> bool:
        """Whether the stack ends in the final norm and lm_head (`logits=True` calls)."""
        return self.stack.lm_head.n > 0

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, logits: bool = False) -> torch.Tensor:
        """x: [T, E] bf16 embeddings, overwritten by the last layer's output; positions, slots, context_lens: [T]
        int64; block_table: [T, nb] int64 (all contiguous) -> the residual stream [T, E] (x not yet added), or
        with `logits` (a stack with a head) every row's logits [T, V] fp32."""
        rows = x.shape[0]
        residual = torch.empty_like(x)
        out = torch.empty(rows, self.stack.lm_head.n, dtype=torch.float32) if logits else None
        workspace, size = self._workspace_for(rows, block_table.shape[1])
        rc = self._run(self._stack_ref, self._layers_ref, x.data_ptr(), residual.data_ptr(), positions.data_ptr(),
                       slots.data_ptr(), block_table.data_ptr(), block_table.shape[1], context_lens.data_ptr(), rows,
                       workspace, size, None if out is None else out.data_ptr())
        if rc == -4:
            raise IndexError(f"a position of {positions.tolist()} is past the RoPE table ({self.stack.max_positions})")
        if rc == -5:
            raise IndexError(f"a slot of {slots.tolist()} is past the KV pool ({self.stack.num_slots})")
        _raise_failure(rc, f"a step of {rows} rows")
        return residual if out is None else out

    def burst(self, embed: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
              steps: int) -> torch.Tensor:
        """A decode burst in one call (a stack with a head): `steps` decode steps of the same rows, each row's
        argmax the next step's token. embed: [V, E] bf16, the embedding table; tokens, positions: [T] int64, the
        first step's; block_table: [T, nb] int64 covering every step's position -> [T, steps] int64 tokens."""
        rows, hidden = tokens.shape[0], self.stack.hidden
        out = torch.empty(rows, steps, dtype=torch.long)
        x = torch.empty(rows, hidden, dtype=torch.bfloat16)
        residual = torch.empty_like(x)
        logits = torch.empty(rows, self.stack.lm_head.n, dtype=torch.float32)
        workspace, size = self._workspace_for(rows, block_table.shape[1])
        rc = self._burst(self._stack_ref, self._layers_ref, embed.data_ptr(), embed.shape[0], tokens.data_ptr(),
                         positions.data_ptr(), block_table.data_ptr(), block_table.shape[1], rows, steps,
                         out.data_ptr(), x.data_ptr(), residual.data_ptr(), logits.data_ptr(), workspace, size)
        if rc == -4:
            raise IndexError(f"a burst's positions from {positions.tolist()} pass the RoPE table "
                             f"({self.stack.max_positions})")
        if rc == -5:
            raise IndexError(f"a burst's positions from {positions.tolist()} pass its block table or the KV pool "
                             f"({self.stack.num_slots} slots)")
        if rc == -6:
            raise IndexError(f"a token of {tokens.tolist()} (or one the burst sampled) is past the embedding table")
        _raise_failure(rc, f"a burst of {steps} steps of {rows} rows")
        return out

    def _workspace_for(self, rows: int, max_blocks: int) -> tuple[int, int]:
        """(64-byte aligned address, bytes) of a workspace for a step of `rows` rows, grown as needed."""
        need = self._workspace_bytes(self._stack_ref, rows, max_blocks)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need + 64, dtype=torch.uint8)
        workspace = self._workspace.data_ptr()
        return workspace + (-workspace % 64), self._workspace.numel() - 64


def _raise_failure(rc: int, what: str) -> None:
    """The loop's codes past its bounds checks: a MoE exchange, or a kernel, that failed midway through `what`."""
    if rc == EXCHANGE_FAILED:
        raise RuntimeError(f"a MoE exchange failed in a C layer loop's {what}")
    if rc != 0:
        raise RuntimeError(f"the C layer loop failed ({rc}) in {what}")


def linear_spec(choices: list[KernelChoice], n: int, k: int, keep: list[torch.Tensor]) -> LinearSpec:
    """`choices` in order of preference (at most LINEAR_OPTIONS): the first that takes a step's rows runs."""
    if len(choices) > LINEAR_OPTIONS:
        raise ValueError(f"a linear has at most {LINEAR_OPTIONS} kernel choices, got {len(choices)}")
    spec = LinearSpec(n=n, k=k)
    for i, c in enumerate(choices):
        keep.extend(t for t in (c.weight, c.bias) if t is not None)
        spec.options[i] = LinearOption(c.kind, c.isa, c.max_rows or 0, c.weight.data_ptr(), c.weight.element_size(),
                                       0 if c.bias is None else c.bias.data_ptr(), c.packed_n)
    return spec


def decode_layers(stack: StackSpec, layers: list[LayerSpec], keep: list[torch.Tensor]) -> DecodeLayers | None:
    lib = cpu_kernels()
    return None if lib is None else DecodeLayers(lib, stack, layers, keep)
