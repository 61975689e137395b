"""Linear layer that picks its compute path by batch size.

On CPUs without native bf16 arithmetic (no AVX512-BF16 / AMX), bf16 GEMMs are emulated:
fine for one-row decodes, which are memory-bound and gain from reading half the bytes,
but several times slower than fp32 for many rows (prefill, big batches), which are
compute-bound. So, where the C kernels (`kvbaton.kernels`) are built:
- a few rows against bf16 weights stream the weights at memory speed (small-batch kernel);
- more rows run an fp32-accumulating GEMM over weights packed once at load time.
Without the kernels, inputs of at least `upcast_min_rows` rows are computed in fp32 by PyTorch
(from a kept fp32 copy of the weights, or converted on the fly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.kernels import PackedLinear, SmallBatchLinear, pack_linear


class Linear(nn.Linear):
    upcast_min_rows: int | None = None  # None: always compute in the weights' dtype
    small_batch_kernel: SmallBatchLinear | None = None  # C kernel for a few rows against bf16 weights
    fp32_weight: torch.Tensor | None = None  # kept fp32 copy for the upcast path (small models only)
    packed: PackedLinear | None = None  # the many-row C kernel with its packed weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.small_batch_kernel  # set only where the weight suits it (set_compute_paths)
        if kernel is not None and kernel.handles_rows(x):
            return kernel(x, self.weight, self.bias)
        if self.packed is not None:
            return self.packed(x)
        rows = self.upcast_min_rows
        if rows is not None and x.dtype != torch.float32 and x.numel() >= rows * x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            weight = self.fp32_weight if self.fp32_weight is not None else self.weight.float()
            return F.linear(x.float(), weight, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def set_compute_paths(model: nn.Module, upcast_min_rows: int | None,
                      small_batch_kernel: SmallBatchLinear | None, keep_fp32_weights: bool = False,
                      pack_weights: bool = False) -> None:
    """Choose each Linear's paths. `pack_weights`: many rows go to the packed C kernel (when built),
    with the weights packed in fp32 if `keep_fp32_weights` (fastest; twice a bf16 model's memory)
    and in bf16 otherwise. `keep_fp32_weights` alone keeps an fp32 copy for PyTorch's upcast path,
    so the weights are not converted on every many-row step."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.upcast_min_rows = upcast_min_rows
            suits = small_batch_kernel is not None and small_batch_kernel.supports_weight(module.weight)
            module.small_batch_kernel = small_batch_kernel if suits else None
            packed_dtype = torch.float32 if keep_fp32_weights else module.weight.dtype
            module.packed = pack_linear(module.weight, module.bias, packed_dtype) if pack_weights else None
            upcast = (module.packed is None and keep_fp32_weights and upcast_min_rows is not None
                      and module.weight.dtype != torch.float32)
            module.fp32_weight = module.weight.detach().float() if upcast else None
