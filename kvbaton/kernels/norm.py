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


class HeadsRMSNorm:
    """Per-head RMSNorm in place over a step's qkv rows (Qwen3's q/k norms), bf16, rounded as AddRMSNorm: the
    function the C layer loop calls on the same rows, so both loops give the same bits."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_rms_norm_heads_bf16
        self.num_threads = num_threads

    @staticmethod
    def handles(qkv: torch.Tensor, weight: torch.Tensor) -> bool:
        return qkv.dtype == weight.dtype == torch.bfloat16 and qkv.dim() == 2 and qkv.is_contiguous()

    def __call__(self, qkv: torch.Tensor, first_head: int, heads: int, weight: torch.Tensor, eps: float) -> None:
        """Normalize heads [first_head, first_head + heads) of every row of `qkv` ([T, n * D]) in place."""
        dim = weight.shape[0]
        start = qkv.data_ptr() + first_head * dim * qkv.element_size()
        self._fn(start, qkv.shape[1], qkv.shape[0], heads, dim, weight.data_ptr(), eps, self.num_threads)


def heads_rms_norm_kernel() -> HeadsRMSNorm | None:
    lib = cpu_kernels()
    return None if lib is None else HeadsRMSNorm(lib, torch.get_num_threads())


def add_rms_norm_kernel() -> AddRMSNorm | None:
    lib = cpu_kernels()
    return None if lib is None else AddRMSNorm(lib, torch.get_num_threads())
