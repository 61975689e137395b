"""RMSNorm, normalized in float32 as HF's Llama/Qwen implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.kernels import AddRMSNorm, HeadsRMSNorm


class RMSNorm(nn.Module):
    kernel: AddRMSNorm | None = None  # C residual-add + norm for bf16 activations (apply_compute_plan)
    heads: HeadsRMSNorm | None = None  # its per-head form, in place over qkv rows (q/k norms), set with `kernel`

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: one fused kernel, which accumulates in fp32 for bf16 inputs too. HF rounds the
        # normalized bf16 activations before scaling; the fused kernel scales first, which can
        # differ in the last bf16 bit (float32 runs, the parity oracle, are unaffected).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`; the first layer has no residual yet: `(norm(x), x)`."""
        kernel = self.kernel
        if kernel is not None and kernel.handles(x):  # set only for a bf16 weight (apply_compute_plan)
            return kernel(x, residual, self.weight, self.eps)  # one pass, HF's roundings
        if residual is not None:
            x = x + residual
        return self(x), x
