"""What the worker pool needs of whatever starts its worker processes (local processes, Ray actors).

Implemented by `kvbaton.cluster.local.LocalLauncher` and `kvbaton.cluster.ray.RayLauncher`; the pool
knows launchers only through this protocol, so `router` never imports `cluster`.
"""

from __future__ import annotations

from typing import Protocol

from kvbaton.messages.worker_spec import WorkerSpec


class Launcher(Protocol):
    """Starts, watches and stops workers by name (`WorkerSpec.name`).

    Contract: `launch` returns once the worker is starting (not when it is ready: readiness is its
    hello to the router); every method but `launch` is safe to call for a name that is unknown or
    already stopped (a no-op, or False/None); nothing a launcher started outlives `close()`. A name
    can be launched again once its worker was killed or stopped: the pool replaces a worker it
    declared dead under the dead one's name (see `kvbaton.router.supervision`)."""

    backend: str  # "local" | "ray": for logs and GET /workers

    def start(self) -> str:
        """Bring up what workers run on (a Ray cluster; nothing for local processes). Returns the
        address the router must listen on so every worker can reach it. Idempotent."""
        ...

    def launch(self, spec: WorkerSpec) -> None:
        """Start one worker (raises if it cannot be placed, or if a worker of that name still runs;
        then nothing of it is kept)."""
        ...

    def launch_group(self, specs: list[WorkerSpec]) -> None:
        """Start the ranks of one expert-parallel group as one unit: placed together (Ray: one placement
        group, a bundle per rank, all or nothing) or not at all. Each rank stays a worker of its own name."""
        ...

    def launch_gang(self, specs: list[WorkerSpec], joining: list[str]) -> None:
        """Start `specs` placed together with the workers named `joining`, which `launch` starts later into the
        places kept for them (an AFD deployment: the expert pool first, the attention workers once its addresses
        are known). Ray: one placement group, a bundle per worker, all or nothing; a replacement goes back into
        its worker's bundle while the group lives. Local processes: `specs` started in turn."""
        ...

    def is_alive(self, name: str) -> bool:
        """Whether the worker's process still runs."""
        ...

    def pid(self, name: str) -> int | None:
        """The worker process's pid, if known."""
        ...

    def kill(self, name: str) -> None:
        """SIGKILL the worker now: fencing a worker declared dead, so a stalled one cannot come back."""
        ...

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for a worker told to shut down to exit, then kill it."""
        ...

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """`stop` every worker this launcher started."""
        ...

    def close(self) -> None:
        """Stop every worker and whatever `start` brought up (a private Ray head). Idempotent."""
        ...
