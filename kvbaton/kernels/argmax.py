"""Greedy sampling's argmax over fp32 logits rows (argmax_rows.c): torch.argmax's choice (the first of equal
maxima, a NaN above everything) in a few microseconds a row instead of ~29."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvbaton.kernels.build import cpu_kernels


class ArgmaxRows:
    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_argmax_rows
        self.num_threads = num_threads

    @staticmethod
    def handles(logits: torch.Tensor) -> bool:
        return logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()

    def __call__(self, logits: torch.Tensor) -> list[int]:
        """[S, V] fp32 -> each row's argmax."""
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._fn(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), self.num_threads)
        return out.tolist()


@functools.cache
def argmax_rows_kernel() -> ArgmaxRows | None:
    lib = cpu_kernels()
    return None if lib is None else ArgmaxRows(lib, torch.get_num_threads())
