"""The colocated worker: prefills and decodes its own requests; moves no KV."""

from __future__ import annotations

from kvbaton.disagg.roles.base import Role
from kvbaton.disagg.spec import WorkerRole


class BothRole(Role):
    role = WorkerRole.BOTH
