"""Random prompts from a printed seed: the same for every engine, distinct within one."""

from __future__ import annotations

import secrets
import zlib

TOKEN_LOW = 100  # random prompt ids avoid the special tokens at the start of the vocabulary


def fresh_seed(headroom: int = 0) -> int:
    """A new base seed for a run; `headroom` leaves room for per-workload offsets above it."""
    return secrets.randbelow(2**31 - headroom)


def make_prompts(seed: int, tag: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` random prompts of `length` token ids, a pure function of (seed, tag).

    Each tag (workload) draws its own stream, so no two workloads share a prompt and no prefix
    or prompt cache can help, while every engine given the same seed sees the same prompts."""
    import numpy as np

    rng = np.random.default_rng([seed, zlib.crc32(tag.encode())])
    return rng.integers(TOKEN_LOW, vocab, size=(n, length)).tolist()
