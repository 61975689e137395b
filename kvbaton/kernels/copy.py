"""Scattered row copy (KV blocks between pools)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvbaton.kernels.build import cpu_kernels

# (dst_addr, src_addr, dst_rows, src_rows, row_bytes); the rows are int64 arrays
CopyRows = Callable[[int, int, np.ndarray, np.ndarray, int], None]


def copy_rows_kernel() -> CopyRows | None:
    """`fn(dst_addr, src_addr, dst_rows: int64 array, src_rows: int64 array, row_bytes)` or None.

    Callers bound-check the rows first: this copies by raw address."""
    lib = cpu_kernels()
    if lib is None:
        return None
    fn, threads = lib.kvbaton_copy_rows, max(1, torch.get_num_threads())

    def copy(dst_addr: int, src_addr: int, dst_rows: np.ndarray, src_rows: np.ndarray, row_bytes: int) -> None:
        fn(dst_addr, src_addr, dst_rows.ctypes.data, src_rows.ctypes.data, len(dst_rows), row_bytes, threads)

    return copy
