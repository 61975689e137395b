"""Moving KV block rows by address: the copier every transport uses, and the bound checks before it."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvbaton.kernels import copy_rows_kernel


class Run(NamedTuple):
    """`length` rows consecutive on both sides: src rows `src..src+length-1` go to `dst..dst+length-1`."""

    src: int
    dst: int
    length: int


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
    for s, d, n in contiguous_runs(src_rows, dst_rows):
        ctypes.memmove(dst_addr + d * row_bytes, src_addr + s * row_bytes, n * row_bytes)


def contiguous_runs(src_rows: Sequence[int], dst_rows: Sequence[int]) -> list[Run]:
    """Pairs `(src_rows[i], dst_rows[i])` merged into runs consecutive on both sides: fewer, larger
    copies or reads. Numpy only where it beats a Python loop."""
    if len(src_rows) <= 64:
        runs: list[Run] = []
        for s, d in zip(src_rows, dst_rows):
            if runs and s == runs[-1].src + runs[-1].length and d == runs[-1].dst + runs[-1].length:
                runs[-1] = runs[-1]._replace(length=runs[-1].length + 1)
            else:
                runs.append(Run(s, d, 1))
        return runs
    src, dst = np.asarray(src_rows, dtype=np.int64), np.asarray(dst_rows, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return [Run(*run) for run in zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist())]
