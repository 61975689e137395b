"""A Mooncake transfer engine with one worker's pools registered, and the protocol it speaks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvbaton.platform.net import is_loopback

if TYPE_CHECKING:  # NOTE: torch: the deployment checks the data plane before any worker imports it
    from kvbaton.kv.pools import KVPools

PROTOCOL_ENV = "KVBATON_MOONCAKE_PROTOCOL"
DEVICE_ENV = "KVBATON_MOONCAKE_DEVICE"
PROTOCOLS = ("tcp", "rdma")


def protocol() -> str:
    value = os.environ.get(PROTOCOL_ENV, "tcp")
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={value!r}: choose one of {', '.join(PROTOCOLS)}")
    return value


def check_data_plane(host: str, allow_insecure: bool) -> None:
    """ValueError unless the operator allowed the unauthenticated data plane explicitly, on loopback too.

    NOTE: Mooncake's transfer engine listens on every interface whatever host it is given (given 127.0.0.1,
    `ss` shows its handshake server on 0.0.0.0:<rpc port> and its data port on *:<port>; MC_TCP_BIND_ADDRESS
    changes neither), so a loopback host keeps nothing off the network."""
    if not allow_insecure:
        where = "on loopback too: it listens on every interface whatever host it is given" if is_loopback(host) \
            else "and it listens on every interface"
        raise ValueError(
            f"refusing to start the mooncake KV transport on {host}: its data plane is unauthenticated (any host "
            f"that reaches its port can read or overwrite the registered KV pools), {where}. On a private, trusted "
            "cluster network pass --allow-insecure-kv-transport (ConnectorSpec.allow_insecure_transport); "
            "otherwise use --kv-transport tcp, whose data is signed")


class Engine:
    """A Mooncake engine with every layer's pool registered (remote peers may access only those).
    Only with `allow_insecure` (see `check_data_plane`)."""

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
