"""An image's patch grid under Qwen2-VL's dynamic resolution, from its size alone: the frontend lays out an
image's placeholders (one per `merge` x `merge` patches) before any worker has seen its pixels, and the workers
place the image's multimodal RoPE positions by the same grid. The arithmetic is the image processor's
(`smart_resize`, Python's rounding included); a test holds it to transformers' processor over many sizes
(tests/mm/test_dynamic_resolution.py). Torch-free.
"""

from __future__ import annotations

import math

from kvbaton.config import DynamicResolution
from kvbaton.sched.sampling_params import InvalidRequestError

MAX_ASPECT = 200  # the processor refuses images longer than this many times their width (or the reverse)


def resized(res: DynamicResolution, width: int, height: int) -> tuple[int, int]:
    """(width, height) the processor resizes an image to: whole multiples of `patch * merge`, the aspect kept as
    closely as they allow, the area within [min_pixels, max_pixels]. InvalidRequestError past MAX_ASPECT."""
    if width < 1 or height < 1:
        raise InvalidRequestError(f"an image of {width}x{height} pixels")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise InvalidRequestError(f"an image of {width}x{height} pixels: its sides may differ by {MAX_ASPECT}x at most")
    factor = res.patch * res.merge
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > res.max_pixels:
        beta = math.sqrt(height * width / res.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < res.min_pixels:
        beta = math.sqrt(res.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return w, h


def merged_grid(res: DynamicResolution, width: int, height: int) -> tuple[int, int]:
    """(rows, columns) of the image's placeholders: its patches, `merge` x `merge` of them in each."""
    w, h = resized(res, width, height)
    factor = res.patch * res.merge
    return h // factor, w // factor
