"""The KV connector contract: how a prefill worker hands a request's KV blocks to a decode worker.

Split by role, like the two halves of vLLM's connector: a `KVSender` lives in the prefill
worker, a `KVReceiver` in the decode worker, each built over that worker's `KVPools`. Both are
called only from their worker's engine loop thread (between steps, and — for `save_layer` —
between layers of a forward pass); any network I/O happens on the transport's own background
threads, so neither call blocks on a peer. Control messages a transport exchanges with its peer
(acks, "layer ready") are `kvbaton.wire.SignedCodec` frames; bulk data is authenticated the same
way unless the transport's medium is private to the cluster (shared memory on one host).

Life of one transfer (the router brokers the first two steps):

    decode:  receiver.expect(request_id, dst_block_ids, deadline)  -> tells the router its address
    prefill: sender.begin(TransferSpec(...))                         (src/dst blocks, receiver address)
    prefill: sender.save_layer(layer, [request_id, ...])   for layer 0..L-1, as each layer finishes
    decode:  receiver.poll() -> completed ids                (all layers written into the pool)
    prefill: sender.poll()   -> completed ids                (receiver confirmed; free the blocks)

Invariants every transport keeps:
- The receiver writes only into the `dst_block_ids` it was told to expect; the caller keeps
  those blocks out of use (not schedulable, not in the prefix cache) until `poll()` reports the
  request completed or failed, or the caller `cancel()`s it.
- The sender reads only `src_block_ids`; the caller keeps them allocated until `poll()`
  reports the request completed or failed, or it `abort()`s it.
- A transfer that cannot finish (peer gone, timeout, layout mismatch) ends as a failure with
  a reason, on both sides, within the deadline — never as a hang.

NOTE: no torch at import time: the scheduler (which imports no torch) carries `TransferSpec`,
`PollResult` and `ConnectorConfig`; only a transport's own modules touch tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import msgspec

from kvbaton.kv.layout import KVLayout

if TYPE_CHECKING:
    from kvbaton.kv.pools import KVPools


class TransferSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the sender needs for one request; travels router -> prefill worker."""

    request_id: str
    src_block_ids: list[int]  # the sender's blocks to send, in order
    dst_block_ids: list[int]  # the receiver's blocks they go to (same length)
    receiver: str  # KVReceiver.address of the decode worker
    layout: KVLayout  # the receiver's layout; the sender refuses a mismatch
    deadline_s: float = 30.0  # seconds from begin() until the transfer counts as failed


TRANSPORTS = ("shm", "tcp", "redis", "mooncake")  # each a package of this one, with `sender` and `receiver`


@dataclass(frozen=True)
class ConnectorConfig:
    transport: str  # a name in kvbaton.kv.connectors.TRANSPORTS
    secret: bytes  # cluster secret, for SignedCodec
    _: KW_ONLY
    host: str = "127.0.0.1"  # address a receiver binds to (tcp, mooncake)
    redis_url: str | None = None  # redis://host:port/db (redis transport)
    redis_ttl_s: int = 60  # keys expire so nothing outlives its use
    worker_name: str = "kvbaton-worker"  # for logs, shm segment names
    allow_insecure_transport: bool = False  # mooncake: start its unauthenticated data plane off loopback
    encrypt_traffic: bool = False  # CURVE on the transport's ZeroMQ sockets (`kvbaton.wire.curve`)


@dataclass(frozen=True)
class PollResult:
    completed: list[str]
    failed: list[tuple[str, str]]  # (request_id, reason)


class KVSender(ABC):
    """Prefill side, over the worker's `pools` (their layout is `self.layout`)."""

    # NOTE: a receiver that writes its own pool converts a sender's other KV dtype (`kvbaton.kv.convert`); a
    # transport whose sender writes into the receiver's memory (mooncake) cannot, and says so here.
    receiver_converts_dtype = True

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        self.config, self.pools, self.layout = config, pools, pools.layout

    @abstractmethod
    def begin(self, spec: TransferSpec) -> None:
        """Register a transfer. Raises what `check_begin` raises."""

    def check_begin(self, spec: TransferSpec, begun: Container[str] = ()) -> None:
        """The checks of every begin(): ValueError if `spec.request_id` is in `begun` (transports whose
        messages cannot tell two attempts at a request apart refuse a second; the others pass nothing
        and supersede the first after this); KVLayoutMismatch if `spec.layout` differs from ours in more
        than a dtype the receiver converts; ValueError if the source and destination lists differ in
        length, or a source block is outside our pools."""
        src, num_blocks = spec.src_block_ids, self.pools.num_blocks
        if spec.request_id in begun:
            raise ValueError(f"transfer {spec.request_id!r} already begun")
        # ours first: the message reads prefill vs decode
        if self.receiver_converts_dtype:
            self.layout.check_transferable(spec.layout)
        else:
            self.layout.check_compatible(spec.layout)
        if len(src) != len(spec.dst_block_ids):
            raise ValueError(f"{len(src)} source blocks for {len(spec.dst_block_ids)} destinations")
        if src and not (0 <= min(src) and max(src) < num_blocks):
            raise ValueError(f"source block ids outside this pool of {num_blocks} blocks")

    @abstractmethod
    def save_layer(self, layer: int, request_ids: list[str]) -> None:
        """Layer `layer` of these requests' blocks is computed: start moving it. Must return
        quickly (it runs between layers of a forward pass)."""

    @abstractmethod
    def poll(self) -> PollResult:
        """Transfers that ended since the last poll: completed (receiver confirmed every layer)
        or failed. Either way the caller may free the source blocks."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a transfer (e.g. the request was cancelled); it is not reported by poll()."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads, close sockets and segments."""


class KVReceiver(ABC):
    """Decode side, over the worker's `pools`. `address` is what senders need to reach it."""

    address: str

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        self.config, self.pools, self.layout = config, pools, pools.layout

    @abstractmethod
    def expect(self, request_id: str, dst_block_ids: list[int], deadline_s: float) -> None:
        """Be ready to receive this request's blocks into `dst_block_ids`."""

    @abstractmethod
    def poll(self) -> PollResult:
        """Requests whose every layer is now in the pool (completed), and ones that failed or
        passed their deadline (failed). Data lands in the pool only inside poll() (the engine
        loop thread), so the pool is never written while a step runs."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stop expecting this request; late data for it is dropped."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads, close sockets and segments."""
