"""A Mooncake transfer engine with one worker's pools registered, and the protocol it speaks."""

from __future__ import annotations

import os

from kvbaton.kv.pools import KVPools
from kvbaton.platform.net import is_loopback

PROTOCOL_ENV = "KVBATON_MOONCAKE_PROTOCOL"
DEVICE_ENV = "KVBATON_MOONCAKE_DEVICE"
PROTOCOLS = ("tcp", "rdma")


def protocol() -> str:
    value = os.environ.get(PROTOCOL_ENV, "tcp")
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={value!r}: choose one of {', '.join(PROTOCOLS)}")
    return value


def check_data_plane(host: str, allow_insecure: bool) -> None:
    """ValueError unless the data plane stays on loopback or the operator allowed it explicitly."""
    if not (allow_insecure or is_loopback(host)):
        raise ValueError(
            f"refusing to start the mooncake KV transport on {host}: its data plane is unauthenticated (any host "
            "that reaches its port can read or overwrite the registered KV pools, and it listens on every "
            "interface). On a private, trusted cluster network pass --allow-insecure-kv-transport "
            "(ConnectorSpec.allow_insecure_transport); otherwise use --kv-transport tcp, whose data is signed")


class Engine:
    """A Mooncake engine with every layer's pool registered (remote peers may access only those).
    Off loopback only with `allow_insecure` (see `check_data_plane`)."""

    def __init__(self, host: str, pools: KVPools, allow_insecure: bool = False) -> None:
        check_data_plane(host, allow_insecure)
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
