from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import MOE_ARCHS, build_tiny_checkpoint, build_tiny_moe_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, root / arch) for arch in ("llama", "llama3", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-moe")
    return {arch: build_tiny_moe_checkpoint(arch, root / arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from kvbaton.models.registry import pull_default_model

    return pull_default_model()
