"""Where a prompt's images stand: runs of `VisionSpec.tokens_per_image` consecutive copies of the image token in
the prompt's token ids, one run per image in order (LLaVA), or with a tile grid (Idefics3 / SmolVLM) one per tile
and one for the global image, text tokens between them, or one run per image as long as its size asks
(Qwen2-VL). Torch-free: the frontend lays the placeholders out and counts them as the workers do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbaton.config import DynamicResolution, VisionSpec
from kvbaton.mm.dynamic_resolution import merged_grid
from kvbaton.mm.tiles import image_prompt, tile_grid
from kvbaton.sched.request import ImageSpan
from kvbaton.sched.sampling_params import InvalidRequestError

MAX_GRIDS_KEPT = 64  # tile grids whose placeholder ids are kept (a few per checkpoint in practice)


def _runs(vision: VisionSpec, token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of image tokens, a run cut after `tokens_per_image` of them (never, for an
    image whose size decides its run: Qwen2-VL's images are apart by their start and end tokens)."""
    runs: list[tuple[int, int]] = []
    most = vision.tokens_per_image or len(token_ids)
    for i, token in enumerate(token_ids):
        if token != vision.image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][1] < most:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _by_image(vision: VisionSpec, token_ids: Sequence[int],
              runs: list[tuple[int, int]]) -> tuple[list[list[tuple[int, int]]], bool]:
    """The runs grouped by image: each its own, or with tiles, up to the run after `<global-img>` (the global
    image's, an image's last); and whether the last group closed so (runs after it are an error)."""
    if vision.tiles is None:
        return [[run] for run in runs], True
    groups: list[list[tuple[int, int]]] = [[]]
    for start, n in runs:
        groups[-1].append((start, n))
        if start > 0 and token_ids[start - 1] == vision.global_image_token_id:
            groups.append([])
    closed = not groups[-1]
    return (groups[:-1] if closed else groups), closed


def image_spans(vision: VisionSpec | None, token_ids: Sequence[int], digests: Sequence[str],
                sizes: Sequence[tuple[int, int]] = ()) -> tuple[ImageSpan, ...]:
    """The spans of `token_ids`' images, the i-th named by `digests[i]`; InvalidRequestError unless the image
    tokens make exactly that many images, each run `tokens_per_image` long. Where an image's size decides its run
    (Qwen2-VL), `sizes` (each image's width and height) give each span its grid, which its run must fill; without
    them (the router: it places no positions) the runs are taken as they are."""
    if vision is None:
        if digests:
            raise InvalidRequestError("this model does not take images")
        return ()
    runs = _runs(vision, token_ids)
    if vision.resolution is not None:
        return _sized_spans(vision.resolution, runs, digests, sizes)
    groups, closed = _by_image(vision, token_ids, runs)
    if not closed or len(groups) != len(digests) or any(n != vision.tokens_per_image for _, n in runs):
        shape = "each image's runs end with the global image's" if vision.tiles is not None else "each image takes"
        raise InvalidRequestError(f"the prompt holds {sum(n for _, n in runs)} image tokens ({vision.image_token_id}) "
                                  f"for {len(digests)} image(s): {shape} {vision.tokens_per_image} in a row")
    spans = []
    for group, digest in zip(groups, digests):
        start, end = group[0][0], group[-1][0] + group[-1][1]
        spans.append(ImageSpan(start, end - start, bytes.fromhex(digest), tuple(group) if len(group) > 1 else ()))
    return tuple(spans)


def _sized_spans(resolution: DynamicResolution, runs: list[tuple[int, int]], digests: Sequence[str],
                 sizes: Sequence[tuple[int, int]]) -> tuple[ImageSpan, ...]:
    if len(runs) != len(digests):
        raise InvalidRequestError(f"the prompt holds {len(runs)} runs of image tokens for {len(digests)} image(s)")
    spans = []
    for i, ((start, n), digest) in enumerate(zip(runs, digests)):
        grid: tuple[int, ...] = ()
        if sizes:
            grid = merged_grid(resolution, *sizes[i])
            if grid[0] * grid[1] != n:
                raise InvalidRequestError(f"image {i} of {sizes[i][0]}x{sizes[i][1]} pixels takes {grid[0] * grid[1]} "
                                          f"image tokens, the prompt holds {n} for it")
        spans.append(ImageSpan(start, n, bytes.fromhex(digest), grid=grid))
    return tuple(spans)


class Placeholders:
    """The token ids that stand for each image of a prompt: `tokens_per_image` image tokens (LLaVA), or the
    text of the image's tile grid (Idefics3 / SmolVLM: its row and column tags, newlines and runs), tokenized by
    `encode` (the model's tokenizer, no special tokens added) once per grid."""

    def __init__(self, vision: VisionSpec, encode: Callable[[str], list[int]]) -> None:
        self.vision, self._encode = vision, encode
        self._by_grid: dict[tuple[int, int], list[int]] = {}

    @property
    def need_sizes(self) -> bool:
        """Whether an image's placeholders depend on its size (its pixels must be decoded, at least its header)."""
        return self.vision.tiles is not None or self.vision.resolution is not None

    def for_image(self, width: int, height: int) -> list[int]:
        vision = self.vision
        if vision.resolution is not None:
            rows, cols = merged_grid(vision.resolution, width, height)
            return [vision.image_token_id] * (rows * cols)
        if vision.tiles is None:
            return [vision.image_token_id] * vision.tokens_per_image
        grid = tile_grid(vision.tiles, width, height)
        ids = self._by_grid.get(grid)
        if ids is None:
            if len(self._by_grid) >= MAX_GRIDS_KEPT:
                self._by_grid.clear()
            ids = self._by_grid[grid] = self._encode(image_prompt(*grid, vision.tokens_per_image))
        return ids

    def expand(self, token_ids: Sequence[int], sizes: Sequence[tuple[int, int]]) -> list[int]:
        """`token_ids` with each image token (a chat template renders one per image, LLaVA's `<image>`) replaced
        by the placeholders of the image of that size (width, height), in order. InvalidRequestError unless the
        prompt holds one image token per image (a client's text cannot add one: the special tokens it types
        are split into ordinary ones)."""
        marks = sum(t == self.vision.image_token_id for t in token_ids)
        if marks != len(sizes):
            raise InvalidRequestError(f"the chat template rendered {marks} image tokens for {len(sizes)} image(s)")
        out: list[int] = []
        images = iter(sizes)
        for t in token_ids:
            if t == self.vision.image_token_id:
                out.extend(self.for_image(*next(images)))
            else:
                out.append(t)
        return out
