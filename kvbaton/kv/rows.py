"""Moving KV block rows by address: the copier every transport uses, and the bound checks before it."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from kvbaton.kernels import copy_rows_kernel
from kvbaton.kv.layout import KVLayout


def rows_within(rows: Sequence[int], limit: int) -> bool:
    if len(rows) == 0:
        return True
    if len(rows) <= 64:
        return 0 <= min(rows) and max(rows) < limit
    arr = np.asarray(rows, dtype=np.int64)
    return bool(arr.min() >= 0 and arr.max() < limit)


def copy_rows(dst_addr: int, dst_rows: Sequence[int], src_addr: int, src_rows: Sequence[int], row_bytes: int) -> None:
    """Copy row src_rows[i] to row dst_rows[i]. Runs consecutive on both sides go in one memmove.

    NOTE: raw addresses, because torch's index_select/index_copy_ move KV rows at a fraction of
    memcpy speed; so every caller bound-checks the rows first (`rows_within`). ctypes releases the
    GIL during the copy, so the other thread keeps going. Many scattered rows go to the C kernel
    (one call, all threads); a few runs, or no compiler, take one memmove per run.
    """
    kernel = copy_rows_kernel() if len(dst_rows) > 8 else None
    if kernel is not None:
        kernel(dst_addr, src_addr, np.ascontiguousarray(dst_rows, dtype=np.int64),
               np.ascontiguousarray(src_rows, dtype=np.int64), row_bytes)
        return
    for d, s, n in _runs(dst_rows, src_rows):
        ctypes.memmove(dst_addr + d * row_bytes, src_addr + s * row_bytes, n * row_bytes)


def _runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of each run; numpy only where it beats a Python loop."""
    if len(dst_rows) <= 64:
        runs: list[tuple[int, int, int]] = []
        for d, s in zip(dst_rows, src_rows):
            if runs and d == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((d, s, 1))
        return runs
    dst, src = np.asarray(dst_rows, dtype=np.int64), np.asarray(src_rows, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [len(dst)])))
    return list(zip(dst[starts].tolist(), src[starts].tolist(), lengths.tolist()))


def pool_rows(kv_caches: list[torch.Tensor], layout: KVLayout) -> int:
    """Blocks per layer pool; the pools must be contiguous, since rows are copied by address."""
    for pool in kv_caches:
        if not pool.is_contiguous() or pool.dtype != layout.torch_dtype:
            raise ValueError("KV pools must be contiguous tensors of the layout's dtype")
    return kv_caches[0].numel() // layout.block_numel
