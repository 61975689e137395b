"""SwiGLU's activation, silu(gate) * up, over bf16 (silu_mul_bf16.c): the one implementation both layer loops
(Python's and decode_layers.c) use, so a token's bits never depend on which ran its step."""

from __future__ import annotations

import ctypes

import torch

from kvbaton.kernels.build import cpu_kernels


class SiluMul:
    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_silu_mul_bf16
        self.num_threads = num_threads

    @staticmethod
    def handles(gate_up: torch.Tensor) -> bool:
        return gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous()

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] (gate, then up) -> [..., I]: bf16(bf16(silu(gate)) * up), as PyTorch rounds it."""
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        self._fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, self.num_threads)
        return out


def silu_mul_kernel() -> SiluMul | None:
    lib = cpu_kernels()
    return None if lib is None else SiluMul(lib, torch.get_num_threads())
