"""Scattered row copy (KV blocks between pools)."""

from __future__ import annotations

import torch

from kvbaton.kernels.build import cpu_kernels


def copy_rows_kernel():
    """`fn(dst_addr, src_addr, dst_rows: int64 array, src_rows: int64 array, row_bytes)` or None.

    Callers bound-check the rows first: this copies by raw address."""
    lib = cpu_kernels()
    if lib is None:
        return None
    fn, threads = lib.kvbaton_copy_rows, max(1, torch.get_num_threads())

    def copy(dst_addr: int, src_addr: int, dst_rows, src_rows, row_bytes: int) -> None:
        fn(dst_addr, src_addr, dst_rows.ctypes.data, src_rows.ctypes.data, len(dst_rows), row_bytes, threads)

    return copy
