"""Linear layer that picks its compute path by batch size, as the engine's `ComputePlan` set it up
(`kvbaton.layers.compute_paths`):
- `rows_kernel`: a C kernel for the row counts it handles: a few rows streaming the weights at memory
  speed (decode), or, in deterministic mode, every row count through one fixed-order dot product;
- `tile_kernel`: kvbaton's AMX GEMM over its own packed weights, for the row counts it handles
  (more than `rows_kernel` takes; every count in deterministic mode);
- `packed`: an fp32-accumulating GEMM over weights packed once at load time (many rows, AVX2 CPUs,
  where bf16 GEMMs are emulated and lose to fp32 ones);
- `onednn`: oneDNN's GEMM over a copy of the weights reordered once into its blocked layout (many rows,
  AVX512-BF16 CPUs without AMX: `F.linear` would repack the weight on every call);
- `upcast_min_rows`: without kernels on such CPUs, that many rows or more compute in fp32 in PyTorch
  (from a kept fp32 copy of the weights, or converted on the fly);
- otherwise PyTorch in the weights' dtype (oneDNN's native bf16 GEMMs, MKL for fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.kernels import AMXLinear, DotLinear, PackedLinear, SmallBatchLinear
from kvbaton.kernels.onednn import OneDNNLinear


class Linear(nn.Linear):
    upcast_min_rows: int | None = None  # None: always compute in the weights' dtype
    rows_kernel: SmallBatchLinear | DotLinear | None = None  # C kernel for the row counts it handles
    fp32_weight: torch.Tensor | None = None  # kept fp32 copy for the upcast path (small models only)
    packed: PackedLinear | None = None  # the many-row C kernel with its packed weights
    tile_kernel: AMXLinear | None = None  # the AMX GEMM with its packed weights
    onednn: OneDNNLinear | None = None  # oneDNN's GEMM with its reordered weights

    def takes_rows_kernel(self, x: torch.Tensor) -> bool:
        return self._rows_kernel_for(x) is not None

    def _rows_kernel_for(self, x: torch.Tensor) -> SmallBatchLinear | DotLinear | None:
        kernel = self.rows_kernel  # set only where the weight suits it (apply_compute_plan)
        return kernel if kernel is not None and kernel.handles_rows(x) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # a step that samples nothing (mid-prompt chunks) still runs the lm_head
            return F.linear(x, self.weight, self.bias)
        rows_kernel = self._rows_kernel_for(x)
        if rows_kernel is not None:
            return rows_kernel(x, self.weight, self.bias)
        tile_kernel = self.tile_kernel
        if tile_kernel is not None and tile_kernel.handles_rows(x):
            return tile_kernel(x)
        if self.packed is not None:
            return self.packed(x)
        if self.onednn is not None:
            return self.onednn(x)
        rows = self.upcast_min_rows
        if rows is not None and x.dtype != torch.float32 and x.numel() >= rows * x.shape[-1]:
            bias = None if self.bias is None else self.bias.float()
            weight = self.fp32_weight if self.fp32_weight is not None else self.weight.float()
            return F.linear(x.float(), weight, bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)
