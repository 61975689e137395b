"""Worker roles by name: what each computes with, which router commands it takes, what it reports (the
contract: `base.py`)."""

from __future__ import annotations

from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.worker.roles.base import Role, WorkerContext
from kvbaton.worker.roles.both import BothRole
from kvbaton.worker.roles.decode import DecodeRole
from kvbaton.worker.roles.encode import EncodeRole
from kvbaton.worker.roles.expert import ExpertRole
from kvbaton.worker.roles.prefill import PrefillRole

ROLES: dict[WorkerRole, type[Role]] = {WorkerRole.PREFILL: PrefillRole, WorkerRole.DECODE: DecodeRole,
                                       WorkerRole.BOTH: BothRole, WorkerRole.EXPERT: ExpertRole,
                                       WorkerRole.ENCODE: EncodeRole}


def role_of(role: WorkerRole) -> Role:
    return ROLES[role]()


__all__ = ["ROLES", "Role", "WorkerContext", "role_of"]
