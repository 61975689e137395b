"""Apply a `ComputePlan` (kvbaton.platform.compute) to a model: give each linear, norm, MLP and MoE layer's
routed experts the code its row of the table names. Attention's choice is the model runner's (it builds the
metadata)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from kvbaton.config import ConfigError
from kvbaton.kernels import (
    add_rms_norm_kernel,
    cpu_kernels,
    dot_linear,
    heads_rms_norm_kernel,
    pack_amx,
    pack_linear,
    small_batch_linear,
)
from kvbaton.kernels.activation import silu_mul_kernel
from kvbaton.kernels.linear import DotLinear, Packer, SmallBatchLinear, amx_enabled, pack_now
from kvbaton.kernels.moe import (
    GATE_MAX_ROWS,
    ISA_AMX,
    ISA_AVX2,
    ISA_AVX512_BF16,
    MoEExpertsKernel,
    moe_experts_kernel,
    moe_route_kernel,
)
from kvbaton.kernels.onednn import onednn_linear
from kvbaton.kernels.pack_cache import PackCache
from kvbaton.kernels.rope import rope_kernel
from kvbaton.layers.linear import Linear
from kvbaton.layers.mlp import MLP
from kvbaton.layers.moe.experts import GroupedExperts
from kvbaton.layers.moe.gate import TopKGate
from kvbaton.layers.norm import RMSNorm
from kvbaton.layers.rope import RotaryEmbedding
from kvbaton.platform.compute import ComputePlan, choose_compute_plan
from kvbaton.platform.cpu import detect_cpu

log = logging.getLogger(__name__)

# NOTE: measured on a 2-core AVX2 EPYC: an (emulated) bf16 GEMM loses to fp32 from ~16 rows on.
UPCAST_MIN_ROWS = 16
# bf16 models up to this size also keep an fp32 copy of their weights for many-row steps.
FP32_WEIGHT_COPY_MAX_BYTES = 2**30
# The AMX GEMM keeps its own tile-packed copy of each weight (the original stays for the dot kernel and the
# embedding), as does the onednn-packed path its reordered one: up to this size; a bigger model computes many rows
# in oneDNN from the plain weights (deterministic: the dot kernel).
AMX_WEIGHT_COPY_MAX_BYTES = 4 * 2**30
# The routed experts of bf16 MoE models: kvbaton's C kernel (moe_experts.c), in the instruction set of the row,
# over the stacked expert weights packed in place (no extra copy), and their softmax gate (logits, softmax, top-k)
# in one C call; fp32 models and the onednn / torch rows keep PyTorch (fp32: the parity oracle's sums).
MOE_KERNEL_ISA = {"amx": ISA_AMX, "avx512-bf16": ISA_AVX512_BF16, "avx2": ISA_AVX2}
# KVBATON_MOE_KERNEL=0: PyTorch's expert loop on every row (benchmarks compare the two with it).
MOE_KERNEL_ENV = "KVBATON_MOE_KERNEL"
# amx: experts with at least this many rows in a step run on AMX tiles, fewer through the vdpbf16ps dot tile
# (a few rows are a pass over the weights); deterministic mode: tiles for every count (batch-invariant).
AMX_MOE_MIN_ROWS = 4


def apply_compute_plan(model: nn.Module, plan: ComputePlan, cache: PackCache | None = None) -> None:
    """`cache`: packed layouts kept from an earlier start of this model under this plan (and kept for the next)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    packer = _packers(cache)
    keep_fp32 = weight_bytes <= FP32_WEIGHT_COPY_MAX_BYTES
    rows_kernel = _rows_kernel(plan)
    norm_kernel = add_rms_norm_kernel() if plan.norm == "c" else None
    heads_norm = heads_rms_norm_kernel() if plan.norm == "c" else None  # q/k norms (shared with the C loop)
    # the C activation goes with the C norms: the rows whose decode steps the C layer loop runs
    silu_mul = silu_mul_kernel() if plan.norm == "c" else None
    rope = rope_kernel() if plan.norm == "c" else None  # and the C RoPE, which that loop uses too
    gated = set()  # gate/up projections computed by their MLP's fused kernel: no plain packed copy
    moe_kernel = moe_kernel_of(plan)
    # the gate: up to GATE_MAX_ROWS tokens (PyTorch beyond), every count in deterministic mode (batch-invariant)
    route_kernel = None if moe_kernel is None else moe_route_kernel(moe_kernel.isa, None if plan.deterministic
                                                                    else GATE_MAX_ROWS)
    moe_layers = 0
    for name, module in model.named_modules():
        if isinstance(module, MLP):
            proj = module.gate_up_proj
            fits = plan.many_rows_linear == "packed" and proj.bias is None and module.intermediate_size % 8 == 0
            packed_dtype = torch.float32 if keep_fp32 else torch.bfloat16
            module.fused_gate_up = pack_linear(proj.weight, None, packed_dtype, gated=True,
                                               packer=packer(f"{name}.fused_gate_up")) if fits else None
            if module.fused_gate_up is not None:
                gated.add(proj)
            module.silu_mul = silu_mul if proj.weight.dtype == torch.bfloat16 else None
        elif isinstance(module, RotaryEmbedding):
            module.kernel = rope
        elif isinstance(module, RMSNorm):
            suits = norm_kernel is not None and norm_kernel.supports_weight(module.weight)
            module.kernel = norm_kernel if suits else None
            module.heads = heads_norm if suits else None
        elif isinstance(module, GroupedExperts) and module.kernel is None and module.num_experts:
            if moe_kernel is not None and moe_kernel.supports(module.gate_up_proj, module.down_proj):
                module.use_kernel(moe_kernel)
                moe_layers += 1
        elif isinstance(module, TopKGate):
            softmax = module.moe.scoring == "softmax"
            suits = route_kernel is not None and softmax and route_kernel.supports(module.weight)
            module.kernel = route_kernel if suits else None
    if moe_kernel is not None and moe_layers:
        log.info("MoE experts: C kernel (%s) in %d layers, weights packed in place", moe_kernel.name, moe_layers)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            _apply_to_linear(module, plan, rows_kernel, keep_fp32, packed=module not in gated,
                             tiles_fit=weight_bytes <= AMX_WEIGHT_COPY_MAX_BYTES,
                             packer=lambda kind, name=name: packer(name + kind))  # type: ignore[misc]
    if cache is not None:
        cache.save()


def _packers(cache: PackCache | None) -> Callable[[str], Packer]:
    """name -> the packer of that weight: through `cache` (by name), or packing at once without one."""
    if cache is None:
        return lambda name: pack_now
    return lambda name: functools.partial(cache.get, name)


def plan_compute(dtype: torch.dtype, compute_path: str = "auto", deterministic: bool = False,
                 kernels: bool = True) -> ComputePlan:
    """The compute plan of this CPU for a model in `dtype` (an engine's, or an expert worker's experts')."""
    cpu = detect_cpu()
    kernels = kernels and (compute_path == "torch" or cpu_kernels() is not None)
    amx = kernels and cpu.amx_bf16 and amx_enabled()
    plan = choose_compute_plan(cpu, str(dtype).removeprefix("torch."), compute_path, deterministic,
                               kernels_available=kernels, amx_granted=amx)
    log.info("compute path %s; CPU %s", plan.summary(), cpu.summary())
    return plan


def moe_kernel_of(plan: ComputePlan) -> MoEExpertsKernel | None:
    """The routed experts' C kernel the plan gives bf16 MoE layers (None: PyTorch's loop)."""
    isa = MOE_KERNEL_ISA.get(plan.path)
    if plan.dtype != "bfloat16" or isa is None or os.environ.get(MOE_KERNEL_ENV, "1") == "0":
        return None
    return moe_experts_kernel(isa, amx_min_rows=1 if plan.deterministic else AMX_MOE_MIN_ROWS)


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
                     keep_fp32: bool, packed: bool, tiles_fit: bool, packer: Callable[[str], Packer]) -> None:
    """`packer(kind)`: the packer of this linear's `kind` of packed copy (".tiles", ".packed")."""
    tiles = plan.many_rows_linear == "amx"
    linear.tile_kernel = (pack_amx(linear.weight, linear.bias, plan.tile_rows, packer(".tiles"))
                          if tiles and tiles_fit else None)
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
    linear.packed = pack_linear(linear.weight, linear.bias, packed_dtype, packer=packer(".packed")) if pack else None
    reorder = plan.many_rows_linear == "onednn-packed" and tiles_fit
    linear.onednn = onednn_linear(linear.weight, linear.bias) if reorder else None
    upcast = plan.many_rows_linear == "torch-fp32" and linear.weight.dtype != torch.float32
    linear.upcast_min_rows = UPCAST_MIN_ROWS if upcast else None
    linear.fp32_weight = linear.weight.detach().float() if upcast and keep_fp32 else None
