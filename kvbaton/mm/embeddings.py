"""An image's embeddings as bytes, and back: what an encoder worker (E/P/D) sends and a language worker takes in
their place. Raw rows of the encoder's dtype, never pickle: a frame from the wire is parsed, not executed, and
whatever it claims is checked against its length before a tensor is made of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class EmbeddingBytes:
    """`rows` x `cols` values of `dtype` (a name in `DTYPES`), row-major."""

    dtype: str
    rows: int
    cols: int
    data: bytes


def to_bytes(embeddings: torch.Tensor) -> EmbeddingBytes:
    if embeddings.dim() != 2 or embeddings.dtype not in DTYPE_NAMES:
        raise ValueError(f"expected 2-D embeddings of {', '.join(DTYPES)}, got {embeddings.dtype} "
                         f"{tuple(embeddings.shape)}")
    rows, cols = embeddings.shape
    data = embeddings.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return EmbeddingBytes(DTYPE_NAMES[embeddings.dtype], rows, cols, data)


def from_bytes(sent: EmbeddingBytes) -> torch.Tensor:
    """The tensor `sent` describes; ValueError unless its bytes are exactly that many values of a known dtype."""
    dtype = DTYPES.get(sent.dtype)
    if dtype is None:
        raise ValueError(f"embeddings of unknown dtype {sent.dtype!r}")
    if sent.rows < 1 or sent.cols < 1 or len(sent.data) != sent.rows * sent.cols * dtype.itemsize:
        raise ValueError(f"embeddings of {len(sent.data)} bytes are not {sent.rows} x {sent.cols} {sent.dtype}")
    return torch.frombuffer(bytearray(sent.data), dtype=torch.uint8).view(dtype).reshape(sent.rows, sent.cols)
