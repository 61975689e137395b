"""`deploy` brings up a typed deployment or nothing: a spec it cannot serve is refused before anything
starts, and a deployment that fails during start-up stops what it had started (workers, and the
private redis-server of the redis transport), with real processes."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvbaton.cluster.deploy import DeploymentSpec, deploy
from kvbaton.config import EngineConfig
from kvbaton.router.errors import EngineDeadError
from kvbaton.router.router import RouterConfig
from kvbaton.text.tokenizer import Tokenizer
from tests.support.procs import child_pids, pid_alive


@pytest.mark.parametrize("kwargs, message", [
    ({"num_decode": 0}, "at least one decode worker"),
    ({"num_prefill": -1}, "no negative pool size"),
    ({"kv_transport": "carrier-pigeon"}, "unknown KV transport 'carrier-pigeon'"),
    ({"router": RouterConfig(decode_policy="fastest")}, "unknown routing policy 'fastest'"),
])
def test_specs_that_cannot_be_served_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeploymentSpec(**kwargs)


def test_failed_start_stops_everything_it_started(tiny_models, tmp_path):
    # the workers' model does not exist: they exit during start-up, after the redis-server is up
    engine = EngineConfig(model=str(tmp_path / "no-such-model"), dtype="float32", num_threads=1)
    spec = DeploymentSpec(num_prefill=1, num_decode=1, kv_transport="redis", log_dir=tmp_path)
    before = set(child_pids(os.getpid()))
    with pytest.raises(EngineDeadError, match="exited during start-up"):
        asyncio.run(asyncio.wait_for(deploy(engine, Tokenizer(tiny_models["llama"]), spec), 120))
    survivors = {p for p in child_pids(os.getpid()) if pid_alive(p)} - before
    assert survivors == set(), "a worker or the redis-server outlived the failed deployment"
    assert "model not found" in (tmp_path / "kvbaton-prefill-0.log").read_text()
