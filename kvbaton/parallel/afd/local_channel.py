"""The same-host control channel of the shared-memory exchanges: a Unix SOCK_SEQPACKET socket per attention
worker and expert worker, carrying the small `DispatchShared` / `CombinedShared` frames.

Why not the ZeroMQ socket the frames can also go over: a round trip through ZeroMQ passes each message through
both sides' I/O threads (four thread wake-ups), 0.19 ms here on 2 vCPUs; a Unix socket wakes the blocked reader
directly, 0.015 ms. With m micro-batches and L MoE layers a decode step pays it 2·m·L times.

Trust: the socket lives in Linux's abstract namespace (no file to leave behind; a replacement expert worker binds
the same name, derived from its TCP address, the moment its predecessor is gone). Anyone on the host could
connect to an abstract name, so both ends check the other's credentials (SO_PEERCRED): only a process of this
user is served, and only a server of this user is believed. Such a process can already read this user's shared
memory and the cluster secret in its environment, so the frames carry no MAC; they are typed and size-bounded."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from kvbaton.wire import Codec

MAX_LOCAL_FRAME_BYTES = 4096  # a DispatchShared / CombinedShared / ExchangeFailed frame, with room
MAX_CONNECTIONS = 256  # per expert worker: attention workers on this host


def local_name(address: str) -> str:
    """The abstract socket name of the expert worker whose exchange socket is at `address` (tcp://host:port)."""
    return "\0kvbaton-afd-" + address.removeprefix("tcp://").replace("/", "_")


def peer_uid(sock: socket.socket) -> int:
    pid_uid_gid = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", pid_uid_gid)[1]


def connect_local(name: str, timeout_s: float) -> socket.socket | None:
    """A connection to the expert worker listening at `name`, if one of this user's does; None otherwise."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout_s)
        sock.connect(name)
        if peer_uid(sock) != os.getuid():
            raise PermissionError("listener of another user")
    except OSError:
        sock.close()
        return None
    return sock


class LocalListener:
    """An expert worker's end: the listening socket and its accepted connections (non-blocking)."""

    def __init__(self, name: str, to_expert: Any, from_expert: Any) -> None:
        self.name = name
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(name)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.connections: dict[int, socket.socket] = {}  # by fd
        self.requests = Codec(to_expert, MAX_LOCAL_FRAME_BYTES)
        self.replies = Codec(from_expert, MAX_LOCAL_FRAME_BYTES)
        self.refused_peers = 0

    def accept(self) -> socket.socket | None:
        """The connection waiting on the listener, if it is this user's (others are closed at once)."""
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return None
        if peer_uid(conn) != os.getuid() or len(self.connections) >= MAX_CONNECTIONS:
            self.refused_peers += 1
            conn.close()
            return None
        conn.setblocking(False)
        self.connections[conn.fileno()] = conn
        return conn

    def drop(self, conn: socket.socket) -> None:
        self.connections.pop(conn.fileno(), None)
        conn.close()

    def close(self) -> None:
        for conn in self.connections.values():
            conn.close()
        self.connections.clear()
        self.listener.close()
