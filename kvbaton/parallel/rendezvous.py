"""Where the ranks of a gloo group meet, bound to the host they were given and no wider.

torch's `TCPStore` server listens on every interface, and gloo's pair sockets on the address the
machine's hostname resolves to (a LAN address on most machines); neither authenticates a peer, and
an expert-parallel group keeps both open for its workers' lifetime. So rank 0 binds the store's
socket itself, to the group's host, and hands it to torch (`master_listen_fd`), and every rank pins
gloo to the interface that carries that host (`GLOO_SOCKET_IFNAME`). Off loopback the sockets are
still unauthenticated: the deployment refuses that unless the operator allowed it
(`--allow-insecure-kv-transport`, `cluster.deploy`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import torch.distributed as dist

from kvbaton.config import ConfigError
from kvbaton.platform.net import interface_of

logger = logging.getLogger(__name__)

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


@dataclass
class Meeting:
    """A group's store (rank 0 hosts it on `listener`, bound to the group's host) until `close`."""

    store: dist.TCPStore
    listener: socket.socket | None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def address_of(init_method: str) -> tuple[str, int]:
    """(host, port) of a `tcp://host:port` rendezvous."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ConfigError(f"a rendezvous is tcp://host:port, not {init_method!r}")
    return parts.hostname, parts.port


def meet(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> Meeting:
    """The store of a group meeting at host:port (port 0 on rank 0: any free one, `store.port`), with gloo
    pinned to `host`'s interface for the groups this process makes next."""
    pin_gloo_to(host)
    if not is_master:
        return Meeting(dist.TCPStore(host, port, world_size, False, timeout=timeout), None)
    listener = socket.create_server((host, port), family=socket.AF_INET, backlog=max(64, world_size))
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    return Meeting(store, listener)


def pin_gloo_to(host: str) -> None:
    """Make gloo's pair sockets listen on the interface of `host` (process-wide: one group per process)."""
    interface = interface_of(host)
    if interface is None:
        logger.warning("no network interface has the address of %s: gloo listens where the hostname resolves",
                       host)
        return
    os.environ[GLOO_INTERFACE_ENV] = interface
