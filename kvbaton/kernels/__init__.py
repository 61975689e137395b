"""Hand-written CPU kernels (plain C, compiled on first use: see `build.py`) with tensor-level wrappers.

Every wrapper factory returns None when the kernels are not built (no compiler, `KVBATON_KERNELS=0`)
or do not handle the shapes; callers then use their PyTorch path.
"""

from kvbaton.kernels.attention import PagedDecodeKernel, PagedPrefillKernel, paged_decode_kernel, paged_prefill_kernel
from kvbaton.kernels.build import cpu_kernels
from kvbaton.kernels.copy import copy_rows_kernel
from kvbaton.kernels.linear import (
    MAX_LINEAR_ROWS,
    AMXLinear,
    DotLinear,
    PackedLinear,
    SmallBatchLinear,
    dot_linear,
    pack_amx,
    pack_linear,
    small_batch_linear,
)
from kvbaton.kernels.moe import MoEExpertsKernel, MoERouteKernel, moe_experts_kernel, moe_route_kernel
from kvbaton.kernels.norm import AddRMSNorm, HeadsRMSNorm, add_rms_norm_kernel, heads_rms_norm_kernel

__all__ = [
    "MAX_LINEAR_ROWS",
    "AMXLinear",
    "AddRMSNorm",
    "DotLinear",
    "HeadsRMSNorm",
    "MoEExpertsKernel",
    "MoERouteKernel",
    "PackedLinear",
    "PagedDecodeKernel",
    "PagedPrefillKernel",
    "SmallBatchLinear",
    "add_rms_norm_kernel",
    "copy_rows_kernel",
    "cpu_kernels",
    "dot_linear",
    "heads_rms_norm_kernel",
    "moe_experts_kernel",
    "moe_route_kernel",
    "pack_amx",
    "pack_linear",
    "paged_decode_kernel",
    "paged_prefill_kernel",
    "small_batch_linear",
]
