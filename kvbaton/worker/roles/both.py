"""The colocated worker: prefills and decodes its own requests; moves no KV."""

from __future__ import annotations

from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.worker.roles.engine_role import EngineRole


class BothRole(EngineRole):
    role = WorkerRole.BOTH
