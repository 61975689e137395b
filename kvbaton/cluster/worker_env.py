"""The environment a launcher starts a worker process with: the same for local processes and Ray actors."""

from __future__ import annotations

import os

import msgspec

from kvbaton.messages.worker_spec import SPEC_ENV, WorkerSpec
from kvbaton.wire import SECRET_ENV
from kvbaton.worker.lifeline import PARENT_ENV


def worker_env(spec: WorkerSpec, secret: bytes) -> dict[str, str]:
    """This process's environment plus what `kvbaton.worker.main` reads from it.

    The cluster secret and the spec (which may hold a Redis password) go through the environment,
    never the command line (`ps` shows argv to everyone)."""
    env = {**os.environ, SECRET_ENV: secret.decode(), SPEC_ENV: msgspec.json.encode(spec).decode(),
           "TOKENIZERS_PARALLELISM": "false", PARENT_ENV: str(os.getpid())}  # the caller starts the worker
    if spec.engine.num_threads:
        # NOTE: the engine sets torch's thread count itself; this holds every other OpenMP pool in
        # the process to the worker's share of cores as well.
        env["OMP_NUM_THREADS"] = str(spec.engine.num_threads)
    return env
