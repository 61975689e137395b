"""A worker's heartbeat: its last known load, sent to the router every `interval_s` from a thread of
its own, so a long prefill step does not look like a dead worker while a stopped or killed process
falls silent (the router declares it dead after its `dead_after_s`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from kvbaton.messages.router_worker import Heartbeat, WorkerLoad
from kvbaton.messages.worker_spec import ROUTER_NAME
from kvbaton.wire import CurveKeys, SequencedCodec, curve_client


class HeartbeatThread:
    def __init__(self, name: str, router: str, interval_s: float, codec: SequencedCodec, ctx: zmq.Context,
                 load: Callable[[], WorkerLoad], curve: CurveKeys | None = None) -> None:
        self.name, self.router, self.interval_s, self._ctx, self._load = name, router, interval_s, ctx, load
        self._curve = curve
        # NOTE: its own codec (a stream of the worker's session, numbered on its own: it travels its own
        # connection) and socket: neither encoders nor ZeroMQ sockets are shared across threads.
        self._codec = codec
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        curve_client(sock, self._curve)
        sock.connect(self.router)
        try:
            while not self._stop.wait(self.interval_s):
                sock.send(self._codec.encode(Heartbeat(self.name, self._load()), ROUTER_NAME))
        finally:
            sock.close()
