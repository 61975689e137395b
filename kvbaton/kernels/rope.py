"""RoPE (rotate-half) over bf16 q and k heads in place (rope_bf16.c): the one implementation both layer loops use
(Python's and decode_layers.c), so a token's bits never depend on which ran its step."""

from __future__ import annotations

import ctypes

import torch

from kvbaton.kernels.build import cpu_kernels

MAX_HEAD_DIM = 256  # rope_bf16.c's


class Rope:
    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_rope_bf16
        self.num_threads = num_threads

    @staticmethod
    def handles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """x: [T, heads, D], its heads adjacent in each row; cos, sin: [T, 1, D] tables in x's dtype, bf16."""
        tokens, _, dim = x.shape
        return (x.dtype == cos.dtype == sin.dtype == torch.bfloat16 and dim <= MAX_HEAD_DIM and dim % 2 == 0
                and x.stride(2) == 1 and x.stride(1) == dim and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape == sin.shape == (tokens, 1, dim))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        tokens, heads, dim = x.shape
        self._fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), None, tokens, heads, dim,
                 self.num_threads)


def rope_kernel() -> Rope | None:
    lib = cpu_kernels()
    return None if lib is None else Rope(lib, torch.get_num_threads())
