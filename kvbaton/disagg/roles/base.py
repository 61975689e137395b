"""What makes a worker's role: how its engine moves KV, and which router commands it takes beyond
those every worker takes (add, abort, drain, shutdown, integrity check; see `disagg.worker`).

A new role (attention or expert workers, a vision encoder) is a new module here: the worker's
loop, sockets and heartbeat stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from kvbaton.disagg.spec import WorkerRole, WorkerSpec
from kvbaton.engine.core import EngineCore, KVTransferConfig
from kvbaton.kv.connectors import ConnectorConfig

Handler = Callable[[Any], None]


class WorkerContext(Protocol):
    """What a role's command handlers may use of their worker."""

    name: str
    core: EngineCore

    def send(self, msg: msgspec.Struct) -> None:
        """Push an event to the router."""
        ...


class Role:
    """A role with no KV hand-off and no commands of its own (the colocated `both` worker)."""

    role: WorkerRole = WorkerRole.BOTH
    sends_kv = False
    receives_kv = False

    def kv_transfer(self, spec: WorkerSpec, secret: bytes) -> KVTransferConfig | None:
        """How this role's engine moves KV (None: it moves none)."""
        if not (self.sends_kv or self.receives_kv):
            return None
        c = spec.connector
        connector = ConnectorConfig(transport=c.transport, secret=secret, host=c.host, redis_url=c.redis_url,
                                    redis_ttl_s=c.redis_ttl_s, worker_name=spec.name,
                                    allow_insecure_transport=c.allow_insecure_transport,
                                    encrypt_traffic=spec.encrypt_traffic)
        return KVTransferConfig(connector, send=self.sends_kv, receive=self.receives_kv)

    def commands(self, worker: WorkerContext) -> dict[type, Handler]:
        """Handlers for the router commands only this role takes."""
        return {}
