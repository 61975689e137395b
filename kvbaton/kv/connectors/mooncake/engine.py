"""A Mooncake transfer engine with one worker's pools registered, and the protocol it speaks."""

from __future__ import annotations

import os

from kvbaton.kv.pools import KVPools

PROTOCOL_ENV = "KVBATON_MOONCAKE_PROTOCOL"
DEVICE_ENV = "KVBATON_MOONCAKE_DEVICE"
PROTOCOLS = ("tcp", "rdma")


def protocol() -> str:
    value = os.environ.get(PROTOCOL_ENV, "tcp")
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={value!r}: choose one of {', '.join(PROTOCOLS)}")
    return value


class Engine:
    """A Mooncake engine with every layer's pool registered (remote peers may access only those)."""

    def __init__(self, host: str, pools: KVPools) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines go to stderr per engine
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError("the mooncake KV transport needs `pip install kvbaton[mooncake]` "
                               "(and libibverbs1: apt-get install libibverbs1)") from exc
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol(), os.environ.get(DEVICE_ENV, "")) != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host} ({protocol()})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.addrs = [pools.address(layer) for layer in range(pools.layout.num_layers)]
        if self.engine.batch_register_memory(self.addrs, [c.nbytes for c in pools.caches]) != 0:
            raise RuntimeError("Mooncake could not register the KV pools")

    def close(self) -> None:
        self.engine.batch_unregister_memory(self.addrs)
        del self.engine
