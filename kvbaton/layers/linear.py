"""Linear layer that picks its compute precision by batch size.

On CPUs without native bf16 arithmetic (no AVX512-BF16 / AMX), bf16 GEMMs are emulated:
fine for one-row decodes, which are memory-bound and gain from reading half the bytes,
but several times slower than fp32 for many rows (prefill, big batches), which are
compute-bound. With `upcast_min_rows` set, inputs of at least that many rows are computed
in fp32 from the same bf16 weights (converted on the fly: cheap next to the GEMM itself).
A few rows against bf16 weights go to a C kernel (`kvbaton.kernels`) that streams the
weights at memory speed, which PyTorch's emulated bf16 GEMM does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.kernels import SmallBatchLinear


class Linear(nn.Linear):
    upcast_min_rows: int | None = None  # None: always compute in the weights' dtype
    small_batch_kernel: SmallBatchLinear | None = None  # C kernel for a few rows against bf16 weights
    fp32_weight: torch.Tensor | None = None  # kept fp32 copy for the upcast path (small models only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.small_batch_kernel  # set only where the weight suits it (set_compute_paths)
        if kernel is not None and kernel.handles_rows(x):
            return kernel(x, self.weight, self.bias)
        rows = self.upcast_min_rows
        if rows is not None and x.dtype != torch.float32 and x.numel() >= rows * x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            weight = self.fp32_weight if self.fp32_weight is not None else self.weight.float()
            return F.linear(x.float(), weight, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def set_compute_paths(model: nn.Module, upcast_min_rows: int | None,
                      small_batch_kernel: SmallBatchLinear | None, keep_fp32_weights: bool = False) -> None:
    """Choose each Linear's paths. `keep_fp32_weights` trades twice the weights' memory for not
    converting them on every many-row step (~1/5 of a 64-request decode step on a 135M model)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.upcast_min_rows = upcast_min_rows
            suits = small_batch_kernel is not None and small_batch_kernel.supports_weight(module.weight)
            module.small_batch_kernel = small_batch_kernel if suits else None
            upcast = keep_fp32_weights and upcast_min_rows is not None and module.weight.dtype != torch.float32
            module.fp32_weight = module.weight.detach().float() if upcast else None
