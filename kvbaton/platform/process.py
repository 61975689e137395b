"""Process-wide settings, made once by each process entry point (the in-process `LLMEngine`, a worker
process), never by a library object: two engines in one process must not fight over them."""

from __future__ import annotations

import gc

import torch


def set_compute_threads(num_threads: int | None) -> None:
    """torch's intra-op threads for this process (None: torch's default, every core)."""
    if num_threads:
        torch.set_num_threads(num_threads)


def freeze_long_lived_objects() -> None:
    """Move everything allocated so far out of the cyclic GC's sight.

    NOTE: called once an engine is built: its modules, weights and tokenizer tables live as long
    as the process, and every collection would walk them again (measured: ~1/4 of a batch-1
    decode step on the default model)."""
    gc.collect()
    gc.freeze()
