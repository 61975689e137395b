"""Qwen2-VL's image grid, computed by the frontend from an image's size alone, against transformers' own image
processor (which resizes and patches the pixels in the worker): the placeholders laid out and the positions given
are the ones the encoder's embeddings fill, for any size and bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from kvbaton.config import DynamicResolution
from kvbaton.mm.dynamic_resolution import merged_grid, resized

BOUNDS = [DynamicResolution(patch=14, merge=2, min_pixels=56 * 56, max_pixels=28 * 28 * 16),
          DynamicResolution(patch=14, merge=2, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
          DynamicResolution(patch=16, merge=2, min_pixels=32 * 32, max_pixels=32 * 32 * 9)]


@pytest.mark.parametrize("res", BOUNDS, ids=lambda r: f"{r.patch}-{r.min_pixels}-{r.max_pixels}")
@settings(max_examples=40, deadline=None, derandomize=True)
@given(width=st.integers(1, 400), height=st.integers(1, 400))
def test_the_grid_is_the_processors(res, width, height):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=res.min_pixels, max_pixels=res.max_pixels,
                                         patch_size=res.patch, merge_size=res.merge)
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    if max(width, height) > 200 * min(width, height):
        with pytest.raises(ValueError):
            processor(images=[image])
        with pytest.raises(ValueError, match="differ by 200x"):
            resized(res, width, height)
        return
    t, rows, cols = processor(images=[image])["image_grid_thw"][0].tolist()
    assert t == 1 and merged_grid(res, width, height) == (rows // res.merge, cols // res.merge)
