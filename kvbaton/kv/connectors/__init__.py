"""KV transports behind one contract (`base.py`), created by name: package `<transport>` has modules
`sender` (a `Sender`) and `receiver` (a `Receiver`), imported only when one is made, so an unused
transport's dependencies are never loaded. Importing this package needs no torch (the scheduler's side).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from kvbaton.kv.connectors.base import TRANSPORTS, ConnectorConfig, KVReceiver, KVSender, PollResult, TransferSpec

if TYPE_CHECKING:
    from kvbaton.kv.pools import KVPools, PoolAllocator

def _role(transport: str, role: str) -> ModuleType:
    """`kvbaton.kv.connectors.<transport>.<role>`, imported now (only the role asked for)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    return importlib.import_module(f"{__name__}.{transport}.{role}")


def make_sender(config: ConnectorConfig, pools: KVPools) -> KVSender:
    """The prefill side of `config.transport` over `pools` (from `pool_allocator(config, sending=True)`)."""
    return _role(config.transport, "sender").Sender(config, pools)


def make_receiver(config: ConnectorConfig, pools: KVPools) -> KVReceiver:
    """The decode side of `config.transport` over `pools`."""
    return _role(config.transport, "receiver").Receiver(config, pools)


def pool_allocator(config: ConnectorConfig, sending: bool) -> PoolAllocator:
    """How a worker that sends (prefill) or receives (decode) over `config.transport` allocates its KV
    pools: a shm sender's in shared memory, named after `config.worker_name`, so receivers copy blocks
    straight out of them (zero-copy); anyone else's in its own memory."""
    if sending and config.transport == "shm":
        from kvbaton.kv.connectors.shm.segments import allocate_shared_pools

        return lambda layout, num_blocks: allocate_shared_pools(layout, num_blocks, config.worker_name)
    from kvbaton.kv.pools import allocate_pools

    return allocate_pools


__all__ = ["TRANSPORTS", "ConnectorConfig", "KVReceiver", "KVSender", "PollResult", "TransferSpec",
           "make_receiver", "make_sender", "pool_allocator"]
