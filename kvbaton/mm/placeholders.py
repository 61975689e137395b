"""Where a prompt's images stand: each image is `VisionSpec.tokens_per_image` consecutive copies of the image
token, in the prompt's token ids, one run per image in order. Torch-free: the frontend counts and places them
as the worker does."""

from __future__ import annotations

from collections.abc import Sequence

from kvbaton.config import VisionSpec
from kvbaton.sched.request import ImageSpan
from kvbaton.sched.sampling_params import InvalidRequestError


def image_spans(vision: VisionSpec | None, token_ids: Sequence[int], digests: Sequence[str]) -> tuple[ImageSpan, ...]:
    """The spans of `token_ids`' images, the i-th named by `digests[i]`; InvalidRequestError unless there are
    exactly as many runs of `tokens_per_image` image tokens as images."""
    if vision is None:
        if digests:
            raise InvalidRequestError("this model does not take images")
        return ()
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != vision.image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i and runs[-1][1] < vision.tokens_per_image:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) != len(digests) or any(n != vision.tokens_per_image for _, n in runs):
        raise InvalidRequestError(f"the prompt holds {sum(n for _, n in runs)} image tokens ({vision.image_token_id}) "
                                  f"for {len(digests)} image(s): each image takes {vision.tokens_per_image} in a row")
    return tuple(ImageSpan(start, n, bytes.fromhex(d)) for (start, n), d in zip(runs, digests))


def expand_placeholders(vision: VisionSpec, token_ids: Sequence[int], num_images: int) -> list[int]:
    """A chat template renders each image as one image token (LLaVA's `<image>`): each becomes the
    `tokens_per_image` placeholders its embeddings fill. InvalidRequestError unless the prompt holds one image
    token per image (a client's text cannot add one: the special tokens it types are split into ordinary ones)."""
    marks = sum(t == vision.image_token_id for t in token_ids)
    if marks != num_images:
        raise InvalidRequestError(f"the chat template rendered {marks} image tokens for {num_images} image(s)")
    out: list[int] = []
    for t in token_ids:
        out.extend([t] * vision.tokens_per_image if t == vision.image_token_id else (t,))
    return out
