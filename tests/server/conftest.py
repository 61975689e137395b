from __future__ import annotations

import pytest

from tests.support.server import kvbaton_server


@pytest.fixture(scope="session")
def default_server(default_model_dir):
    with kvbaton_server("--dtype", "float32", "--max-model-len", "1024") as (base, proc):
        yield base
