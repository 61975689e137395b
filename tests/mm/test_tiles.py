"""The frontend's tile grid of an image (Idefics3 / SmolVLM), computed from its size alone, against transformers'
own image processor, which cuts the pixels in the worker: the placeholders the frontend lays out are the ones the
encoder's embeddings fill, for any size and any of the processor's settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from kvbaton.config import TileGrid
from kvbaton.mm.tiles import image_prompt, tile_grid

SETTINGS = [TileGrid(longest_edge=96, tile=32, split=True), TileGrid(longest_edge=150, tile=48, split=True),
            TileGrid(longest_edge=None, tile=40, split=True), TileGrid(longest_edge=96, tile=32, split=False)]


def processor(grid: TileGrid):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    size = {"longest_edge": grid.longest_edge} if grid.longest_edge else {"longest_edge": 1}
    return Idefics3ImageProcessorPil(size=size, do_resize=grid.longest_edge is not None,
                                     max_image_size={"longest_edge": grid.tile}, do_image_splitting=grid.split)


@pytest.mark.parametrize("grid", SETTINGS, ids=lambda g: f"{g.longest_edge}-{g.tile}-{g.split}")
@settings(max_examples=40, deadline=None, derandomize=True)
@given(width=st.integers(1, 260), height=st.integers(1, 260))
def test_the_grid_is_the_processors(grid, width, height):
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    out = processor(grid)(images=[[image]], return_row_col_info=True)
    rows, cols = out["rows"][0][0], out["cols"][0][0]
    assert tile_grid(grid, width, height) == (rows, cols)
    assert out["pixel_values"].shape[1] == (rows * cols + 1 if rows else 1)  # the tiles, then the global image


def test_the_prompt_is_the_processors(default_model_dir, tmp_path):
    from transformers import Idefics3Processor

    from tests.support.vision import build_tiny_idefics3

    model = build_tiny_idefics3(tmp_path / "m", default_model_dir)
    proc = Idefics3Processor.from_pretrained(str(model))
    for rows, cols in [(0, 0), (1, 2), (3, 1), (2, 3)]:
        inputs = {"rows": [[rows]], "cols": [[cols]]}
        assert proc.replace_image_token(inputs, 0) == image_prompt(rows, cols, proc.image_seq_len)
