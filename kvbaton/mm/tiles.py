"""An image's tile grid and the text that stands for it in the prompt (Idefics3 / SmolVLM), computed from its
size alone: the frontend places an image's placeholders before any worker has seen its pixels, and stays
torch-free. The arithmetic is the image processor's, step for step (its rounding included); a test holds it to
transformers' processor over many sizes (tests/mm/test_tiles.py).
"""

from __future__ import annotations

import math

from kvbaton.config import TileGrid

# NOTE: transformers' Idefics3 processor caps a resized image's edge at this, whatever its settings say
MAX_IMAGE_EDGE = 4096


def resized(grid: TileGrid, width: int, height: int) -> tuple[int, int]:
    """(width, height) after the processor's first resize (none without `grid.longest_edge`): the longest edge to
    `grid.longest_edge`, the other by the aspect ratio, rounded down then up to even, then both within
    MAX_IMAGE_EDGE, never below 1."""
    if grid.longest_edge is None:
        return width, height
    aspect = width / height
    if width >= height:
        width = grid.longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = grid.longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_EDGE:
        width, height = MAX_IMAGE_EDGE, int(MAX_IMAGE_EDGE / aspect)
    elif height > width and height > MAX_IMAGE_EDGE:
        height, width = MAX_IMAGE_EDGE, int(MAX_IMAGE_EDGE * aspect)
    return max(width, 1), max(height, 1)


def tile_grid(grid: TileGrid, width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of tiles an image of this size is cut into; (0, 0): only the global image."""
    if not grid.split:
        return 0, 0
    width, height = resized(grid, width, height)
    tile = grid.tile
    aspect = width / height
    # to whole tiles: the longer edge first, the other from it by the aspect ratio, then rounded up
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return height // tile, width // tile
    return 0, 0


def image_prompt(rows: int, cols: int, tokens_per_tile: int) -> str:
    """The text the processor puts in place of one `<image>`: each tile's run after its row and column tag, a
    newline after each row, then the global image's run."""
    run = "<image>" * tokens_per_tile
    tiles = "".join("".join(f"<fake_token_around_image><row_{r}_col_{c}>{run}" for c in range(1, cols + 1)) + "\n"
                    for r in range(1, rows + 1))
    return f"{tiles}{chr(10) if rows else ''}<fake_token_around_image><global-img>{run}<fake_token_around_image>"
