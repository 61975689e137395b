from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.helpers import MOE_ARCHS, build_tiny_checkpoint, build_tiny_moe_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest_plugins = ["tests.support.budget"]  # the suite's wall time and peak RSS, at the end of every run


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


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    """The tiny Llama of `tiny_models` (the disaggregation and fault tests' model)."""
    return tiny_models["llama"]
