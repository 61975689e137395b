"""Choose where each layer of a bf16 model computes, on CPUs without native bf16 arithmetic."""

from __future__ import annotations

import torch
from torch import nn

from kvbaton.kernels import add_rms_norm_kernel, pack_linear, small_batch_linear
from kvbaton.layers.linear import Linear
from kvbaton.layers.mlp import MLP
from kvbaton.layers.norm import RMSNorm


def set_compute_paths(model: nn.Module, upcast_min_rows: int | None, kernels: bool,
                      keep_fp32_weights: bool = False) -> None:
    """With `kernels` (and the C kernels built): a few rows stream bf16 weights (small-batch kernel),
    more rows run the packed GEMM, with weights packed in fp32 if `keep_fp32_weights` (fastest;
    twice a bf16 model's memory) and in bf16 otherwise; MLPs apply silu(gate) * up inside that GEMM
    and norms fuse the residual add. Without: many rows upcast to fp32 in PyTorch, from a kept fp32
    weight copy if `keep_fp32_weights`, so the weights are not converted on every such step."""
    small_batch = small_batch_linear() if kernels else None
    norm_kernel = add_rms_norm_kernel() if kernels else None
    gated = set()  # gate/up projections computed by their MLP's fused kernel: no plain packed copy
    for module in model.modules():
        if isinstance(module, MLP):
            proj = module.gate_up_proj
            fits = kernels and proj.bias is None and module.intermediate_size % 8 == 0
            packed_dtype = torch.float32 if keep_fp32_weights else torch.bfloat16
            module.fused_gate_up = pack_linear(proj.weight, None, packed_dtype, gated=True) if fits else None
            if module.fused_gate_up is not None:
                gated.add(proj)
        elif isinstance(module, RMSNorm):
            suits = norm_kernel is not None and norm_kernel.supports_weight(module.weight)
            module.kernel = norm_kernel if suits else None
    for module in model.modules():
        if isinstance(module, Linear):
            module.upcast_min_rows = upcast_min_rows
            suits = small_batch is not None and small_batch.supports_weight(module.weight)
            module.small_batch_kernel = small_batch if suits else None
            packed_dtype = torch.float32 if keep_fp32_weights else module.weight.dtype
            pack = kernels and module not in gated
            module.packed = pack_linear(module.weight, module.bias, packed_dtype) if pack else None
            # NOTE: also when kernels were asked for but could not be built (no compiler).
            upcast = (module.packed is None and module not in gated and keep_fp32_weights
                      and upcast_min_rows is not None and module.weight.dtype != torch.float32)
            module.fp32_weight = module.weight.detach().float() if upcast else None
