"""Where kvbaton keeps what it builds once (converted models, compiled kernels).

The bottom layer: it imports nothing of kvbaton, so every other module may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVBATON_CACHE"


def cache_root() -> Path:
    """`$KVBATON_CACHE`, else `~/.cache/kvbaton`."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "kvbaton"))


def models_dir() -> Path:
    return cache_root() / "models"


def gguf_dir() -> Path:
    return cache_root() / "gguf"


def kernels_dir() -> Path:
    return cache_root() / "kernels"
