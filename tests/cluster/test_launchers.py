"""Both launchers implement `kvbaton.router.launcher.Launcher`, method for method (no cluster needed)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import msgspec
import pytest

from kvbaton.cluster.local import LocalLauncher, LocalWorker
from kvbaton.cluster.ray import RayLauncher
from kvbaton.cluster.worker_env import worker_env
from kvbaton.config import EngineConfig
from kvbaton.messages.worker_spec import SPEC_ENV, WorkerRole, WorkerSpec
from kvbaton.router.launcher import Launcher
from kvbaton.wire import SECRET_ENV

SECRET = b"0123456789abcdef0123"
PROTOCOL_METHODS = [name for name, member in vars(Launcher).items()
                    if inspect.isfunction(member) and not name.startswith("_")]


def launchers() -> list[Launcher]:
    # Typed as the protocol, so a type checker refuses either class if it stops satisfying it.
    local: Launcher = LocalLauncher(SECRET)
    ray: Launcher = RayLauncher(SECRET)  # constructing starts nothing
    return [local, ray]


def test_the_protocol_has_the_methods_the_pool_drives():
    assert PROTOCOL_METHODS == ["start", "launch", "launch_group", "launch_gang", "is_alive", "pid", "kill", "stop",
                                "stop_all", "close"]


@pytest.mark.parametrize("cls", [LocalLauncher, RayLauncher])
def test_every_protocol_method_has_the_protocols_signature(cls):
    for name in PROTOCOL_METHODS:
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(Launcher, name)), name
    assert cls.backend in ("local", "ray")


def test_unknown_names_are_no_ops_and_close_is_idempotent():
    for launcher in launchers():
        assert not launcher.is_alive("kvbaton-decode-9") and launcher.pid("kvbaton-decode-9") is None
        if launcher.backend == "local":  # the Ray launcher's other methods need a cluster
            launcher.kill("kvbaton-decode-9")
            launcher.stop("kvbaton-decode-9")
            launcher.stop_all()
        launcher.close()
        launcher.close()


def test_local_start_is_loopback_and_close_leaves_no_worker_running():
    launcher = LocalLauncher(SECRET)
    assert launcher.start() == launcher.start() == "127.0.0.1"
    spec = WorkerSpec(role=WorkerRole.DECODE, index=0, engine=EngineConfig(model="unused"), router="tcp://127.0.0.1:1")
    # noqa: TID251 - a worker that never exits (it sleeps in its own process) is the behaviour under test
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher.workers[spec.name] = LocalWorker(spec, proc)
    assert launcher.is_alive(spec.name) and launcher.pid(spec.name) == proc.pid
    launcher.close()
    assert proc.poll() is not None and launcher.workers == {}


def test_the_worker_env_carries_secret_and_spec_never_argv():
    spec = WorkerSpec(role=WorkerRole.PREFILL, index=1, engine=EngineConfig(model="unused", num_threads=3),
                      router="tcp://127.0.0.1:1")
    env = worker_env(spec, SECRET)
    assert env[SECRET_ENV] == SECRET.decode() and env["OMP_NUM_THREADS"] == "3"
    assert env["TOKENIZERS_PARALLELISM"] == "false" and '"role":"prefill"' in env[SPEC_ENV]
    assert env["PATH"] == os.environ["PATH"]
    unthreaded = msgspec.structs.replace(spec, engine=EngineConfig(model="unused"))
    assert worker_env(unthreaded, SECRET).get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")  # inherited
