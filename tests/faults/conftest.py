from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The harnesses of the disaggregation and server tests, shared rather than copied.
for _harness in ("disagg", "server"):
    sys.path.insert(0, str(Path(__file__).parent.parent / _harness))


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]
