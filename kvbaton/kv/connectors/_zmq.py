"""The ZeroMQ plumbing of the `shm` and `tcp` transports: one I/O thread per connector, which owns
every socket, and the raw row copier both transports use to move KV blocks.

Threads: the engine loop thread calls a connector's public methods; its `IOThread` owns the sockets
and does the slow work (gathering, MACs, sends). They meet in two places only: work handed to the
I/O thread with `IOThread.call`, and an inbox deque the engine thread drains in `poll()`.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from kvbaton.kernels import copy_rows_kernel
from kvbaton.kv.layout import KVLayout

logger = logging.getLogger(__name__)

PEER_LINGER_MS = 200  # unsent messages to a peer are kept this long on close, then dropped


class IOThread:
    """The one thread that touches a connector's sockets (ZeroMQ sockets are not thread-safe).
    Readers are registered before `start()`; other threads hand it work with `call(fn)`."""

    def __init__(self, name: str) -> None:
        self.ctx = zmq.Context()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        wake = f"inproc://wake-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        self._readers: dict[zmq.Socket, Callable[[list[zmq.Frame]], None]] = {}
        self._peers: dict[str, zmq.Socket] = {}
        self._running = True  # False once close() has begun (guards the wake socket)
        self._stopping = False  # set on the I/O thread by the last call close() queues
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def bind_pull(self, host: str, max_msg_bytes: int, handler: Callable[[list[zmq.Frame]], None]) -> str:
        """A PULL socket on `host`, port chosen by the OS; returns its `tcp://host:port`."""
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)  # libzmq drops a peer that sends a bigger frame
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        sock.bind(f"tcp://{host}:0")
        self._readers[sock] = handler
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread, soon; from any thread."""
        self._calls.put(fn)
        with self._wake_lock:
            if self._running:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # wake-ups already queued: the thread is about to run anyway
                    pass

    def peer(self, endpoint: str) -> zmq.Socket:
        """A PUSH socket connected to `endpoint` (I/O thread only). Unbounded queue: what a dead peer
        holds is freed by `drop_peer` once its transfers fail."""
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, PEER_LINGER_MS)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            self._peers[endpoint] = sock
        return sock

    def drop_peer(self, endpoint: str) -> None:
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
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

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._wake_rx, *self._readers):
            poller.register(sock, zmq.POLLIN)
        while not self._stopping:
            for sock, _ in poller.poll():
                if sock is self._wake_rx:
                    self._drain(sock, lambda frames: None)
                else:
                    self._drain(sock, self._readers[sock])
            self._run_calls()
        for sock in (self._wake_rx, *self._readers, *self._peers.values()):
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


def _safely(fn: Callable[..., None], *args: Any) -> None:
    """One bad frame or failed send must not stop the I/O thread."""
    try:
        fn(*args)
    except Exception:
        logger.exception("KV transport I/O thread: %s failed", getattr(fn, "__name__", fn))


# -- rows -----------------------------------------------------------------------------------------------


def rows_within(rows: Sequence[int], limit: int) -> bool:
    if len(rows) == 0:
        return True
    if len(rows) <= 64:
        return 0 <= min(rows) and max(rows) < limit
    arr = np.asarray(rows, dtype=np.int64)
    return bool(arr.min() >= 0 and arr.max() < limit)


def copy_rows(dst_addr: int, dst_rows: Sequence[int], src_addr: int, src_rows: Sequence[int], row_bytes: int) -> None:
    """Copy row src_rows[i] to row dst_rows[i]. Runs consecutive on both sides go in one memmove.

    NOTE: raw addresses, because torch's index_select/index_copy_ move KV rows at a fraction of
    memcpy speed; so every caller bound-checks the rows first (`rows_within`). ctypes releases the
    GIL during the copy, so the other thread keeps going. Many scattered rows go to the C kernel
    (one call, all threads); a few runs, or no compiler, take one memmove per run.
    """
    kernel = copy_rows_kernel() if len(dst_rows) > 8 else None
    if kernel is not None:
        kernel(dst_addr, src_addr, np.ascontiguousarray(dst_rows, dtype=np.int64),
               np.ascontiguousarray(src_rows, dtype=np.int64), row_bytes)
        return
    for d, s, n in _runs(dst_rows, src_rows):
        ctypes.memmove(dst_addr + d * row_bytes, src_addr + s * row_bytes, n * row_bytes)


def _runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of each run; numpy only where it beats a Python loop."""
    if len(dst_rows) <= 64:
        runs: list[tuple[int, int, int]] = []
        for d, s in zip(dst_rows, src_rows):
            if runs and d == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((d, s, 1))
        return runs
    dst, src = np.asarray(dst_rows, dtype=np.int64), np.asarray(src_rows, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [len(dst)])))
    return list(zip(dst[starts].tolist(), src[starts].tolist(), lengths.tolist()))


def pool_rows(kv_caches: list[torch.Tensor], layout: KVLayout) -> int:
    """Blocks per layer pool; the pools must be contiguous, since rows are copied by address."""
    for pool in kv_caches:
        if not pool.is_contiguous() or pool.dtype != layout.torch_dtype:
            raise ValueError("KV pools must be contiguous tensors of the layout's dtype")
    return kv_caches[0].numel() // layout.block_numel
