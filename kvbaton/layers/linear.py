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

from kvbaton.kernels import PackedLinear, SmallBatchLinear


class Linear(nn.Linear):
    upcast_min_rows: int | None = None  # None: always compute in the weights' dtype
    small_batch_kernel: SmallBatchLinear | None = None  # C kernel for a few rows against bf16 weights
    fp32_weight: torch.Tensor | None = None  # kept fp32 copy for the upcast path (small models only)
    packed: PackedLinear | None = None  # the many-row C kernel with its packed weights

    def takes_small_batch(self, x: torch.Tensor) -> bool:
        return self._small_batch_kernel_for(x) is not None

    def _small_batch_kernel_for(self, x: torch.Tensor) -> SmallBatchLinear | None:
        kernel = self.small_batch_kernel  # set only where the weight suits it (set_compute_paths)
        return kernel if kernel is not None and kernel.handles_rows(x) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small_batch = self._small_batch_kernel_for(x)
        if small_batch is not None:
            return small_batch(x, self.weight, self.bias)
        if self.packed is not None:
            return self.packed(x)
        rows = self.upcast_min_rows
        if rows is not None and x.dtype != torch.float32 and x.numel() >= rows * x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            weight = self.fp32_weight if self.fp32_weight is not None else self.weight.float()
            return F.linear(x.float(), weight, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)
