"""Keeping a Ray cluster on 127.0.0.1: pinning Ray's node-IP choice, and checking the outcome."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
import ray._private.ray_constants as ray_constants

LOOPBACK = "127.0.0.1"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class SavedClusterMode:
    """What `pin_loopback` changed, for `restore`."""

    enable_ray_cluster: bool
    env: str | None

    def restore(self) -> None:
        ray_constants.ENABLE_RAY_CLUSTER = self.enable_ray_cluster
        if self.env is None:
            os.environ.pop(SINGLE_MACHINE_ENV, None)
        else:
            os.environ[SINGLE_MACHINE_ENV] = self.env


def pin_loopback() -> SavedClusterMode:
    """Make Ray keep 127.0.0.1 as the node IP, in this process and all it starts."""
    # NOTE: Ray swaps 127.0.0.1 for the host's network address whenever it picks a node IP,
    # except in its single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on
    # macOS and Windows), where the GCS, every node and every worker use 127.0.0.1. The
    # variable reaches the head we start and all it starts; this process read it when it
    # imported Ray, so the constant Ray consults at each lookup is set as well (restored by
    # `SavedClusterMode.restore`). `check_loopback` verifies the outcome.
    saved = SavedClusterMode(enable_ray_cluster=ray_constants.ENABLE_RAY_CLUSTER,
                             env=os.environ.get(SINGLE_MACHINE_ENV))
    os.environ[SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    return saved


def check_loopback() -> None:
    """Raise unless the GCS and every live node of the connected cluster are on 127.0.0.1."""
    gcs = ray.get_runtime_context().gcs_address
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    if not gcs.startswith(f"{LOOPBACK}:") or any(ip != LOOPBACK for ip in nodes):
        raise RuntimeError(f"Ray is not on loopback: GCS at {gcs}, nodes at {nodes}")
