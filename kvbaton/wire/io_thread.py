"""One background thread that owns a set of ZeroMQ sockets (ZeroMQ sockets are not thread-safe).

Used by the KV transports: the engine loop thread calls a connector's public methods; its
`IOThread` owns the sockets and does the slow work (gathering, MACs, sends). They meet in two
places only: work handed to the I/O thread with `IOThread.call`, and an inbox the engine
thread drains in `poll()`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

from kvbaton.wire.curve import CurveKeys, curve_client, curve_server

logger = logging.getLogger(__name__)

PEER_LINGER_MS = 200  # unsent messages to a peer are kept this long on close, then dropped


class IOThread:
    """The one thread that touches a connector's sockets (ZeroMQ sockets are not thread-safe).
    Bound sockets are made before `start()`, peers on the I/O thread; other threads hand it work
    with `call(fn)`. With `curve` keys, its tcp sockets (bound and peers) are CURVE-encrypted."""

    def __init__(self, name: str, curve: CurveKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.curve = curve
        self._calls: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        wake = f"inproc://wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        self._readers: dict[zmq.Socket, Callable[[list[zmq.Frame]], None]] = {}
        self._poller = zmq.Poller()  # the readers' sockets, and the wake socket
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._peers: dict[str, zmq.Socket] = {}
        self._running = True  # False once close() has begun (guards the wake socket)
        self._stopping = False  # set on the I/O thread by the last call close() queues
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def bind_pull(self, host: str, max_msg_bytes: int, handler: Callable[[list[zmq.Frame]], None]) -> str:
        """A PULL socket on `host`, port chosen by the OS; returns its `tcp://host:port`."""
        return self.bind(host, max_msg_bytes, handler).getsockopt_string(zmq.LAST_ENDPOINT)

    def bind(self, host: str, max_msg_bytes: int, handler: Callable[[list[zmq.Frame]], None],
             kind: int = zmq.PULL) -> zmq.Socket:
        """A socket of `kind` (PULL, or ROUTER to answer peers by identity) bound on `host`, port chosen
        by the OS; `handler` gets its messages. Before `start()`; then only the I/O thread touches it."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)  # libzmq drops a peer that sends a bigger frame
        sock.setsockopt(zmq.LINGER, 0)
        curve_server(sock, self.curve)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        sock.bind(f"tcp://{host}:0")
        self._watch(sock, handler)
        return sock

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the I/O thread, soon; from any thread (its result is ignored)."""
        self._calls.put(fn)
        with self._wake_lock:
            if self._running:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # wake-ups already queued: the thread is about to run anyway
                    pass

    def peer(self, endpoint: str, reader: Callable[[list[zmq.Frame]], None] | None = None,
             max_msg_bytes: int = -1) -> zmq.Socket:
        """A PUSH socket connected to `endpoint` (I/O thread only), or with a `reader` a DEALER whose
        replies (up to `max_msg_bytes`) go to it. PUSH: unbounded queue, so what a dead peer holds is
        freed by `drop_peer` once its transfers fail; DEALER: zmq's default bound, past which a
        NOBLOCK send raises zmq.Again, for owners that never drop a peer."""
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH if reader is None else zmq.DEALER)
            if reader is None:
                sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
            sock.setsockopt(zmq.LINGER, PEER_LINGER_MS)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            curve_client(sock, self.curve)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            self._peers[endpoint] = sock
            if reader is not None:
                self._watch(sock, reader)
        return sock

    def drop_peer(self, endpoint: str) -> None:
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            if self._readers.pop(sock, None) is not None:
                self._poller.unregister(sock)
            sock.close(linger=PEER_LINGER_MS)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._wake_lock:
            if not self._running:
                return
        self.call(self._stop)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._wake_lock:
            self._running = False
            self._wake_tx.close(linger=0)
        if self._thread.is_alive():  # stuck in a handler; term() would wait for it forever
            logger.error("%s did not stop within %.1fs", self._thread.name, timeout_s)
            return
        self.ctx.term()

    def _stop(self) -> None:
        self._stopping = True

    def _watch(self, sock: zmq.Socket, handler: Callable[[list[zmq.Frame]], None]) -> None:
        self._readers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def _run(self) -> None:
        while not self._stopping:
            for sock, _ in self._poller.poll():
                if sock is self._wake_rx:
                    self._drain(sock, lambda frames: None)
                elif sock in self._readers:  # else a handler dropped it this round
                    self._drain(sock, self._readers[sock])
            self._run_calls()
        for sock in {self._wake_rx, *self._readers, *self._peers.values()}:
            sock.close()

    def _drain(self, sock: zmq.Socket, handler: Callable[[list[zmq.Frame]], None], batch: int = 64) -> None:
        for _ in range(batch):  # bounded, so queued calls (acks, sends) are not starved by a flood
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            _safely(handler, frames)

    def _run_calls(self) -> None:
        while not self._stopping:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            _safely(fn)


def _safely(fn: Callable[..., object], *args: Any) -> None:
    """One bad frame or failed send must not stop the I/O thread."""
    try:
        fn(*args)
    except Exception:
        logger.exception("KV transport I/O thread: %s failed", getattr(fn, "__name__", fn))
