"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), gate and up in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.kernels import PackedLinear
from kvbaton.kernels.activation import SiluMul
from kvbaton.layers.linear import Linear


class MLP(nn.Module):
    # gate_up_proj packed for the C GEMM with silu(gate) * up in its epilogue (apply_compute_plan)
    fused_gate_up: PackedLinear | None = None
    # silu(gate) * up for bf16 in C: the same code as the C layer loop's, so both loops give the same bits
    silu_mul: SiluMul | None = None

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None and not self.gate_up_proj.takes_rows_kernel(x):
            return self.down_proj(self.fused_gate_up(x))
        gate_up = self.gate_up_proj(x)
        if self.silu_mul is not None and self.silu_mul.handles(gate_up):
            return self.down_proj(self.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
