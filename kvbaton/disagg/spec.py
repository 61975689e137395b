"""What a launcher (local processes or Ray actors) tells a worker, as one typed, JSON-able struct."""

from __future__ import annotations

import msgspec

from kvbaton.config import EngineConfig

SPEC_ENV = "KVBATON_WORKER_SPEC"  # how a launcher hands a worker its spec (never argv: `ps` shows argv)
ROLES = ("prefill", "decode", "both")  # "both": a colocated worker (prefills and decodes its own requests)


class ConnectorSpec(msgspec.Struct, frozen=True):
    transport: str = "shm"  # see kvbaton.kv.connectors.TRANSPORTS
    host: str = "127.0.0.1"  # address the worker's KV receiver binds to
    redis_url: str | None = None
    redis_ttl_s: int = 60


class WorkerSpec(msgspec.Struct, frozen=True):
    role: str  # one of ROLES
    index: int  # unique within its role: the process is titled kvbaton-{role}-{index}
    engine: EngineConfig
    router: str  # tcp://host:port the worker connects to and pushes its events to
    host: str = "127.0.0.1"  # the worker binds its command socket here (port chosen by the OS)
    connector: ConnectorSpec = ConnectorSpec()
    heartbeat_s: float = 0.5

    @property
    def name(self) -> str:
        return f"kvbaton-{self.role}-{self.index}"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
