"""What a launcher (local processes or Ray actors) tells a worker, as one typed, JSON-able struct."""

from __future__ import annotations

import enum

import msgspec

from kvbaton.config import EngineConfig

SPEC_ENV = "KVBATON_WORKER_SPEC"  # how a launcher hands a worker its spec (never argv: `ps` shows argv)
ROUTER_NAME = "kvbaton-router"  # the router's endpoint name on the control channel


class WorkerRole(str, enum.Enum):
    """What a worker does with a request. A `str` enum: serialised as its value."""

    PREFILL = "prefill"  # computes prompts and sends their KV to a decode worker
    DECODE = "decode"  # receives prompts' KV and decodes (or prefills short prompts itself)
    BOTH = "both"  # colocated: prefills and decodes its own requests
    # attention/FFN disaggregation: serves every MoE layer's routed experts it owns to the decode (both) workers,
    # which are then its attention workers; it has no engine core and takes no request
    EXPERT = "expert"
    # E/P/D: encodes requests' images (the vision tower and projector) for the language workers, which take the
    # embeddings instead of the pixels; it has no engine core and takes only `EncodeImages`
    ENCODE = "encode"

    @property
    def decodes(self) -> bool:
        return self in (WorkerRole.DECODE, WorkerRole.BOTH)


class ConnectorSpec(msgspec.Struct, frozen=True, kw_only=True):
    transport: str = "shm"  # see kvbaton.kv.connectors.TRANSPORTS
    host: str = "127.0.0.1"  # address the worker's KV receiver binds to
    redis_url: str | None = None
    redis_ttl_s: int = 60
    # mooncake: its data plane is unauthenticated; off loopback only when the operator says so
    allow_insecure_transport: bool = False


class ExpertSlot(msgspec.Struct, frozen=True, kw_only=True):
    """An expert worker's place in the AFD expert pool: rank `rank` of `size` (it owns that rank's experts of the
    contiguous placement, and with `redundant` slots copies of the next ranks'), its exchange socket on `port` of
    the worker's host: 0 (the OS's choice) at the first start; the pool then keeps the port the worker's hello
    names, so a replacement listens where the attention workers already connect."""

    rank: int
    size: int
    port: int
    redundant: int = 0  # the pool's redundant slots: copies of the next ranks' experts (`ExpertMap.mirrored`)


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    role: WorkerRole
    index: int  # unique within its role: the process is titled kvbaton-{role}-{index}
    engine: EngineConfig
    router: str  # tcp://host:port the worker connects to and pushes its events to
    host: str = "127.0.0.1"  # the worker binds its command socket here (port chosen by the OS)
    connector: ConnectorSpec = ConnectorSpec()
    heartbeat_s: float = 0.5
    # the router's session nonce (hex): the worker takes commands only from it, addresses its events to it
    router_session: str = ""
    # CURVE on the worker's ZeroMQ sockets: control (commands, events, heartbeat) and its KV transport's
    encrypt_traffic: bool = False
    # the expert-parallel group this worker is a rank of (its engine's `expert_parallel` says which): the
    # pool starts, tears down and restarts a group's ranks together; None: a worker on its own
    ep_group: str | None = None
    expert_slot: ExpertSlot | None = None  # the expert role's place in the expert pool (None for the others)

    def __post_init__(self) -> None:
        if not isinstance(self.role, WorkerRole):
            raise ValueError(f"role must be one of {', '.join(r.value for r in WorkerRole)}, not {self.role!r}")
        if (self.role == WorkerRole.EXPERT) != (self.expert_slot is not None):
            raise ValueError("an expert worker, and only it, has an expert slot")

    @property
    def name(self) -> str:
        return worker_name(self.role, self.index)


def worker_name(role: WorkerRole, index: int) -> str:
    return f"kvbaton-{role.value}-{index}"
