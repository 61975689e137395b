"""CURVE on kvbaton's ZeroMQ sockets (`kvbaton serve --encrypt-traffic`): keys from the cluster secret,
who can talk to a CURVE server, and what the bytes on the wire look like. Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvbaton.wire import CurveKeys, IOThread, curve_client, curve_server

SECRET = b"curve-test-secret-0123456789abcdef"
OTHER_SECRET = b"another-cluster-secret-0123456789"
MARKER = b"KVBATON-PLAINTEXT-MARKER:prompt_token_ids=[17, 4, 99]"



@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pull(ctx: zmq.Context, keys: CurveKeys | None) -> tuple[zmq.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    curve_server(sock, keys)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


def push(ctx: zmq.Context, port: int, keys: CurveKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, keys)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def received(sock: zmq.Socket, timeout_ms: int) -> list[bytes]:
    """What arrives within `timeout_ms` (bounded)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            got.append(sock.recv())
    return got


def test_keys_are_deterministic_per_secret_and_differ_across_secrets():
    keys = CurveKeys.from_secret(SECRET)
    assert keys == CurveKeys.from_secret(SECRET)
    other = CurveKeys.from_secret(OTHER_SECRET)
    assert keys.server != other.server and keys.client != other.client
    assert keys.server != keys.client
    for pair in (keys.server, keys.client):
        assert len(pair.public) == len(pair.secret) == 40
        assert zmq.curve_public(pair.secret) == pair.public
    assert keys.server.secret not in repr(keys).encode()


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        CurveKeys.from_secret(b"short")


def test_curve_client_with_the_right_keys_talks_to_a_curve_server(ctx):
    keys = CurveKeys.from_secret(SECRET)
    server, port = pull(ctx, keys)
    client = push(ctx, port, CurveKeys.from_secret(SECRET))  # derived anew, as another process would
    client.send(MARKER)
    assert server.poll(5000) and server.recv() == MARKER


@pytest.mark.parametrize("client_keys", [None, CurveKeys.from_secret(OTHER_SECRET)], ids=["plain", "other-secret"])
def test_a_client_without_the_clusters_keys_never_gets_a_message_through(ctx, client_keys):
    keys = CurveKeys.from_secret(SECRET)
    server, port = pull(ctx, keys)
    stranger = push(ctx, port, client_keys)
    for _ in range(5):
        stranger.send(MARKER)
    friend = push(ctx, port, keys)
    friend.send(b"from a friend")  # the socket still serves its legitimate peers
    assert received(server, 1500) == [b"from a friend"]


class RawProxy:
    """A raw TCP relay between a client and `upstream_port`, keeping every byte the client sent."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.client_bytes = bytearray()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(5)
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        pumps = [threading.Thread(target=self._pump, args=(client, upstream, self.client_bytes), daemon=True),
                 threading.Thread(target=self._pump, args=(upstream, client, bytearray()), daemon=True)]
        self._threads += pumps
        for pump in pumps:
            pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, seen: bytearray) -> None:
        src.settimeout(0.1)
        while not self._stop.is_set():
            try:
                chunk = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            seen += chunk
            dst.sendall(chunk)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.listener.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "curve"])
def test_the_bytes_on_the_wire_are_not_the_plaintext(ctx, encrypt):
    keys = CurveKeys.from_secret(SECRET) if encrypt else None
    server, port = pull(ctx, keys)
    proxy = RawProxy(port)
    try:
        client = push(ctx, proxy.port, keys)
        client.send(MARKER)
        assert server.poll(5000) and server.recv() == MARKER  # it went through the proxy
        client.close()
    finally:
        proxy.close()
    assert (MARKER in proxy.client_bytes) is not encrypt
    assert len(proxy.client_bytes) > len(MARKER)


def test_io_thread_sockets_are_curve_with_keys():
    """The KV transports' sockets: a bound PULL and a peer PUSH of two `IOThread`s with the same keys talk;
    a plain peer of a third does not reach the CURVE socket."""
    keys = CurveKeys.from_secret(SECRET)
    got: list[bytes] = []
    arrived = threading.Event()

    def on_frames(frames: list[zmq.Frame]) -> None:
        got.append(frames[0].bytes)
        arrived.set()

    server, friend, stranger = IOThread("curve-rx", keys), IOThread("curve-tx", keys), IOThread("plain-tx")
    try:
        address = server.bind_pull("127.0.0.1", 2**16, on_frames)
        for io in (server, friend, stranger):
            io.start()
        stranger.call(lambda: stranger.peer(address).send(b"stranger"))
        friend.call(lambda: friend.peer(address).send(b"friend"))
        assert arrived.wait(5)
        # room for the stranger's frame, were it let through: nothing may arrive, so no condition to wait for
        time.sleep(0.5)  # noqa: TID251 - watching a window for what must NOT happen: the window is the check
        assert got == [b"friend"]
    finally:
        for io in (stranger, friend, server):
            io.close()
