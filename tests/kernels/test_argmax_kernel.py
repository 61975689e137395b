"""The C argmax of greedy sampling (argmax_rows.c) picks what torch.argmax picks, row by row: the first of equal
maxima, a NaN above every number, whatever the row's length and where in it (vector body or tail) they fall."""

from __future__ import annotations

import pytest
import torch

from kvbaton.kernels.argmax import argmax_rows_kernel


def rows_with_edges(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=g) for _ in range(4)]
    tied = torch.randn(width, generator=g)
    tied[torch.randperm(width, generator=g)[:3]] = 9.0  # equal maxima in different lanes (or the tail)
    rows.append(tied)
    rows.append(torch.full((width,), float("-inf")))  # a row its masks left empty
    last = torch.randn(width, generator=g)
    last[-1] = 7.0  # the maximum in the tail
    rows.append(last)
    zeros = torch.zeros(width)
    zeros[width // 2] = -0.0  # -0.0 equals 0.0: the first zero wins
    rows.append(zeros)
    inf = torch.randn(width, generator=g)
    inf[width // 3] = float("inf")
    rows.append(inf)
    for at in sorted({0, width // 2, width - 1}):
        nan = torch.randn(width, generator=g)
        nan[at] = float("nan")
        if width > 2:
            nan[(at + 1) % width] = 50.0  # a larger number elsewhere: NaN still wins
        rows.append(nan)
    return torch.stack(rows)


@pytest.mark.parametrize("width", [1, 5, 15, 16, 17, 100, 49152, 49157])
def test_the_c_argmax_picks_what_torch_picks(width):
    kernel = argmax_rows_kernel()
    assert kernel is not None, "kvbaton's C kernels did not build (CI machines have gcc: no skip)"
    logits = rows_with_edges(width)
    assert kernel.handles(logits)
    assert kernel(logits) == logits.argmax(dim=-1).tolist()
