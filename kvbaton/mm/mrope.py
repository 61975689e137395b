"""Qwen2-VL's multimodal RoPE positions: an image's placeholders take (t, row, column) positions offset by where
the image starts, the text after it goes on from past the image's largest position; so a prompt's positions run
behind its token indices by a `delta` that every later token (generated ones too) keeps. The same arithmetic as
transformers' `get_rope_index`, for images (one temporal step each)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbaton.sched.request import ImageSpan


@dataclass(frozen=True)
class MropePositions:
    """A prompt's positions [3, prompt length] (t, row, column; equal for text), and the offset of every token
    after it: position = index + delta."""

    prompt: torch.Tensor
    delta: int

    def of(self, start: int, end: int) -> torch.Tensor:
        """The positions [3, end - start] of tokens start..end-1 (past the prompt: index + delta)."""
        out = (torch.arange(start, end, dtype=torch.long) + self.delta).unsqueeze(0).repeat(3, 1)
        known = min(end, self.prompt.shape[1])
        if start < known:
            out[:, :known - start] = self.prompt[:, start:known]
        return out


def mrope_positions(num_tokens: int, spans: Sequence[ImageSpan]) -> MropePositions:
    """The positions of a prompt of `num_tokens` whose images are `spans` (each one run, its grid set)."""
    rows: list[list[int]] = [[], [], []]
    current = index = 0
    for span in spans:
        if not span.grid or span.rows != span.grid[0] * span.grid[1]:
            raise ValueError(f"an image of {span.rows} placeholders without the grid they fill: {span.grid}")
        for axis in rows:  # the text before the image
            axis.extend(range(current, current + span.start - index))
        current += span.start - index
        height, width = span.grid
        rows[0].extend([current] * (height * width))
        rows[1].extend(current + r for r in range(height) for _ in range(width))
        rows[2].extend(current + c for _ in range(height) for c in range(width))
        current += max(height, width)
        index = span.start + span.length
    for axis in rows:  # the text after the last image
        axis.extend(range(current, current + num_tokens - index))
    current += num_tokens - index
    return MropePositions(torch.tensor(rows, dtype=torch.long), current - num_tokens)
