"""Residual add + RMSNorm over bf16 activations in one pass (norm_bf16.c)."""

from __future__ import annotations

import ctypes

import torch

from kvbaton.kernels.build import cpu_kernels


class AddRMSNorm:
    """`(x, residual) -> (RMSNorm(x + residual) * weight, x + residual)`, bf16, rounded as HF's Llama
    rounds; without a residual, `(RMSNorm(x) * weight, x)`."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_add_rms_norm_bf16
        self.num_threads = num_threads

    @staticmethod
    def supports_weight(weight: torch.Tensor) -> bool:
        """What does not change from step to step: checked once per norm, when paths are chosen."""
        return weight.dtype == torch.bfloat16 and weight.is_contiguous()

    @staticmethod
    def handles(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.is_contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        dim = x.shape[-1]
        out = torch.empty_like(x)
        new_residual = x if residual is None else torch.empty_like(x)
        delta = 0 if residual is None else residual.contiguous().data_ptr()
        self._fn(x.data_ptr(), delta, new_residual.data_ptr(), out.data_ptr(), weight.data_ptr(),
                 x.numel() // dim, dim, eps, self.num_threads)
        return out, new_residual


def add_rms_norm_kernel() -> AddRMSNorm | None:
    lib = cpu_kernels()
    return None if lib is None else AddRMSNorm(lib, torch.get_num_threads())
