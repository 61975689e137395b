"""Worker roles by name: what each does with KV and which router commands it takes."""

from __future__ import annotations

from kvbaton.disagg.roles.base import Role, WorkerContext
from kvbaton.disagg.roles.both import BothRole
from kvbaton.disagg.roles.decode import DecodeRole
from kvbaton.disagg.roles.prefill import PrefillRole
from kvbaton.disagg.spec import WorkerRole

ROLES: dict[WorkerRole, type[Role]] = {WorkerRole.PREFILL: PrefillRole, WorkerRole.DECODE: DecodeRole,
                                       WorkerRole.BOTH: BothRole}


def role_of(role: WorkerRole) -> Role:
    return ROLES[role]()


__all__ = ["ROLES", "Role", "WorkerContext", "role_of"]
