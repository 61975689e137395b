"""Apply a `ComputePlan` (kvbaton.platform.compute) to a model: give each linear, norm and MLP the
code its row of the table names. Attention's choice is the model runner's (it builds the metadata)."""

from __future__ import annotations

import torch
from torch import nn

from kvbaton.config import ConfigError
from kvbaton.kernels import add_rms_norm_kernel, dot_linear, pack_amx, pack_linear, small_batch_linear
from kvbaton.kernels.linear import DotLinear, SmallBatchLinear
from kvbaton.layers.linear import Linear
from kvbaton.layers.mlp import MLP
from kvbaton.layers.norm import RMSNorm
from kvbaton.platform.compute import ComputePlan

# NOTE: measured on a 2-core AVX2 EPYC: an (emulated) bf16 GEMM loses to fp32 from ~16 rows on.
UPCAST_MIN_ROWS = 16
# bf16 models up to this size also keep an fp32 copy of their weights for many-row steps.
FP32_WEIGHT_COPY_MAX_BYTES = 2**30
# The AMX GEMM keeps its own tile-packed copy of each weight (the original stays for the dot kernel and the
# embedding): up to this size; a bigger model computes many rows in oneDNN (deterministic: the dot kernel).
AMX_WEIGHT_COPY_MAX_BYTES = 4 * 2**30


def apply_compute_plan(model: nn.Module, plan: ComputePlan) -> None:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    keep_fp32 = weight_bytes <= FP32_WEIGHT_COPY_MAX_BYTES
    rows_kernel = _rows_kernel(plan)
    norm_kernel = add_rms_norm_kernel() if plan.norm == "c" else None
    gated = set()  # gate/up projections computed by their MLP's fused kernel: no plain packed copy
    for module in model.modules():
        if isinstance(module, MLP):
            proj = module.gate_up_proj
            fits = plan.many_rows_linear == "packed" and proj.bias is None and module.intermediate_size % 8 == 0
            packed_dtype = torch.float32 if keep_fp32 else torch.bfloat16
            module.fused_gate_up = pack_linear(proj.weight, None, packed_dtype, gated=True) if fits else None
            if module.fused_gate_up is not None:
                gated.add(proj)
        elif isinstance(module, RMSNorm):
            suits = norm_kernel is not None and norm_kernel.supports_weight(module.weight)
            module.kernel = norm_kernel if suits else None
    for module in model.modules():
        if isinstance(module, Linear):
            _apply_to_linear(module, plan, rows_kernel, keep_fp32, packed=module not in gated,
                             tiles_fit=weight_bytes <= AMX_WEIGHT_COPY_MAX_BYTES)


def _rows_kernel(plan: ComputePlan) -> SmallBatchLinear | DotLinear | None:
    """The C kernel that takes the rows it handles (`handles_rows`): a few, or (deterministic) every count."""
    code = plan.few_rows_linear
    if code == "stream-avx2":
        return small_batch_linear()
    if code in ("dot-avx512bf16", "dot-generic"):
        every_count = plan.many_rows_linear == code
        return dot_linear(code == "dot-avx512bf16", max_rows=None if every_count else plan.few_rows)
    return None


def _apply_to_linear(linear: Linear, plan: ComputePlan, rows_kernel: SmallBatchLinear | DotLinear | None,
                     keep_fp32: bool, packed: bool, tiles_fit: bool) -> None:
    tiles = plan.many_rows_linear == "amx"
    linear.tile_kernel = pack_amx(linear.weight, linear.bias, plan.tile_rows) if tiles and tiles_fit else None
    if plan.deterministic and tiles and linear.tile_kernel is None:
        # a weight the tiles do not take (K not a multiple of 32): the dot kernel, for every row count
        rows_kernel = dot_linear(True, max_rows=None)
    suits = rows_kernel is not None and rows_kernel.supports_weight(linear.weight)
    linear.rows_kernel = rows_kernel if suits else None
    if plan.deterministic and not (suits or linear.tile_kernel is not None):
        raise ConfigError(f"--deterministic: the batch-invariant linear kernel does not take a {linear.weight.dtype} "
                          f"weight of shape {tuple(linear.weight.shape)}")
    packed_dtype = torch.float32 if keep_fp32 else linear.weight.dtype
    pack = plan.many_rows_linear == "packed" and packed
    linear.packed = pack_linear(linear.weight, linear.bias, packed_dtype) if pack else None
    upcast = plan.many_rows_linear == "torch-fp32" and linear.weight.dtype != torch.float32
    linear.upcast_min_rows = UPCAST_MIN_ROWS if upcast else None
    linear.fp32_weight = linear.weight.detach().float() if upcast and keep_fp32 else None
