from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]
