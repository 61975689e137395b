"""Frame fuzzing against a real worker process and a real router: garbage, truncated, bit-flipped,
oversized, forged, misaddressed, replayed and reordered frames are refused and logged, and the
worker still answers a valid request correctly after every batch.

One router (a `WorkerPool` over a `LocalLauncher`) runs on an event loop of its own thread for the
whole module; the worker's events reach it through a tap (a PULL -> PUSH forwarder) that keeps a
copy of every frame, so the tests can replay what the worker really sent. Router -> worker frames
are signed by the router's own codec (what it would have put on the wire) and sent from here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.cluster.local import LocalLauncher
from kvbaton.config import CacheConfig, EngineConfig
from kvbaton.messages.router_worker import AbortRequests, Drain, FromWorker, Heartbeat, WorkerHello, WorkerOutputs
from kvbaton.messages.worker_spec import ROUTER_NAME, ConnectorSpec, WorkerSpec
from kvbaton.router.router import Router, RouterConfig
from kvbaton.router.worker_pool import PoolConfig, WorkerPool
from kvbaton.text.tokenizer import Tokenizer
from kvbaton.wire import MAX_CONTROL_FRAME_BYTES, Peer, SequencedCodec
from tests.support.helpers import tiny_prompts
from tests.support.pd import collect
from tests.support.wait import wait_until

SECRET = secrets.token_hex(32).encode()
WORKER = "kvbaton-both-0"
HEADER_BYTES = 32 + 44  # MAC, then the fixed part of a sequenced header (names follow)


class Tap:
    """Forwards the worker's event frames to the router, keeping a copy of each."""

    def __init__(self, ctx: zmq.Context, router: str) -> None:
        self.frames: list[bytes] = []
        self._pull, self._push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.address = f"tcp://127.0.0.1:{self._pull.bind_to_random_port('tcp://127.0.0.1')}"
        self._push.connect(router)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._pull.poll(50):
                frame = self._pull.recv()
                self.frames.append(frame)
                self._push.send(frame)
        for sock in (self._pull, self._push):
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def last(self, kind: type) -> bytes:
        return next(f for f in reversed(self.frames) if isinstance(payload(f), kind))


class TappingLauncher(LocalLauncher):
    """A LocalLauncher whose workers push their events through a `Tap`."""

    def __init__(self, secret: bytes, log_dir: Path, ctx: zmq.Context) -> None:
        super().__init__(secret, log_dir)
        self.ctx, self.tap, self.specs = ctx, None, {}

    def launch(self, spec: WorkerSpec) -> None:
        if self.tap is None:
            self.tap = Tap(self.ctx, spec.router)
        self.specs[spec.name] = spec
        super().launch(msgspec.structs.replace(spec, router=self.tap.address))


def payload(frame: bytes) -> Any:
    """The message in a sequenced frame, unverified (the tests read what they captured)."""
    n_from, n_to = frame[HEADER_BYTES - 2], frame[HEADER_BYTES - 1]
    return msgspec.msgpack.decode(frame[HEADER_BYTES + n_from + n_to:], type=FromWorker)


def sender_session(frame: bytes) -> bytes:
    return frame[32 + 10:32 + 26]


class Cluster:
    """The router's event loop on a thread of its own, so hypothesis tests can drive it synchronously."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.log = log_dir / f"{WORKER}.log"
        self.ctx = zmq.Context()
        self.launcher = TappingLauncher(SECRET, log_dir, self.ctx)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self.router: Router = self.call(self._start(model_dir), 180)
        self.prompt = tiny_prompts(5, [10])[0]
        self._requests = 0
        self.expected = self.generate()
        self.commands = self.ctx.socket(zmq.PUSH)  # the attacker's connection to the worker's command socket
        self.commands.setsockopt(zmq.LINGER, 1000)
        self.commands.connect(self.worker.address)
        self.events = self.ctx.socket(zmq.PUSH)  # and to the router's event socket
        self.events.setsockopt(zmq.LINGER, 1000)
        self.events.connect(self.pool.address)

    async def _start(self, model_dir: Path) -> Router:
        engine = EngineConfig(model=str(model_dir), dtype="float32", num_threads=1,
                              cache=CacheConfig(block_size=4, num_blocks=128))
        pool = WorkerPool(engine, self.launcher, SECRET, PoolConfig(heartbeat_s=0.2, dead_after_s=5.0,
                                                                      start_timeout_s=120.0), ConnectorSpec())
        router = Router(pool, Tokenizer(model_dir), RouterConfig())
        await router.start(0, 1)
        return router

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def pool(self) -> WorkerPool:
        return self.router.pool

    @property
    def worker(self) -> Any:
        return self.pool.workers[WORKER]

    def worker_session(self) -> bytes:
        session = self.pool._codec.session_of(WORKER)
        assert session is not None
        return session

    def router_frame(self, msg: msgspec.Struct) -> bytes:
        """`msg` signed and numbered by the router's own codec, for the worker: as if captured on the wire."""
        async def encode() -> bytes:
            return self.pool._codec.encode(msg, WORKER)
        return self.call(encode())

    def generate(self) -> list[int]:
        self._requests += 1
        return self.call(collect(self.router, f"fuzz-{self._requests}", self.prompt, 6))

    def refusals(self) -> int:
        return self.log.read_text().count("refused a frame")

    def wait_for(self, done: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
        wait_until(done, timeout_s, interval_s=0.02, message=f"timed out waiting for {what}")

    def send_and_count(self, frames: list[bytes], sock: zmq.Socket | None = None) -> None:
        """Send frames the worker must refuse; wait until it logged one refusal for each, and no more."""
        before = self.refusals()
        for frame in frames:
            (sock or self.commands).send(frame)
        self.wait_for(lambda: self.refusals() >= before + len(frames), f"{len(frames)} refusals")
        time.sleep(0.05)  # noqa: TID251 - watching a window for a refusal too many: "and no more" is the check
        assert self.refusals() == before + len(frames)

    def assert_serving(self) -> None:
        assert self.generate() == self.expected
        assert self.worker.alive and not self.worker.draining

    def close(self) -> None:
        for sock in (self.commands, self.events):
            sock.close(linger=0)
        with contextlib.suppress(Exception):
            self.call(self.router.shutdown(), 30)
        self.launcher.close()
        if self.launcher.tap is not None:
            self.launcher.tap.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.ctx.term()


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(tiny_llama, tmp_path_factory.mktemp("fuzz-logs"))
    try:
        yield c
    finally:
        c.close()


# ---- the worker's command socket ---------------------------------------------------------------


@st.composite
def bad_frames(draw: st.DrawFn, genuine: list[bytes]) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "extended"]))
    if kind == "random":
        return draw(st.binary(max_size=2048))
    frame = bytearray(draw(st.sampled_from(genuine)))
    if kind == "truncated":
        return bytes(frame[:draw(st.integers(0, len(frame) - 1))])
    if kind == "extended":
        return bytes(frame) + draw(st.binary(min_size=1, max_size=64))
    for pos in draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=4, unique=True)):
        frame[pos // 8] ^= 1 << (pos % 8)
    return bytes(frame)


def test_garbage_is_refused_and_logged_and_the_worker_keeps_serving(cluster):
    # never delivered intact: only damaged copies of these reach the worker
    genuine = [cluster.router_frame(m) for m in (Drain(), AbortRequests(["fuzz-x"]), AbortRequests(["y"] * 40))]

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.lists(bad_frames(genuine), min_size=1, max_size=6))
    def batch(frames: list[bytes]) -> None:
        cluster.send_and_count(frames)
        cluster.assert_serving()

    batch()


def test_replayed_reordered_forged_misaddressed_and_oversized_commands(cluster, caplog):
    caplog.set_level(logging.WARNING)
    outputs_before = len([f for f in cluster.launcher.tap.frames if isinstance(payload(f), WorkerOutputs)])
    abort = cluster.router_frame(AbortRequests(["fuzz-nobody"]))
    cluster.commands.send(abort)  # genuine: taken (the worker answers with its load)
    cluster.wait_for(lambda: len([f for f in cluster.launcher.tap.frames if isinstance(payload(f), WorkerOutputs)])
                     > outputs_before, "the abort's WorkerOutputs")
    cluster.send_and_count([abort, abort])  # replays
    drain = cluster.router_frame(Drain())
    cluster.commands.send(drain)  # genuine, but the router never asked: it must ignore the worker's Drained
    cluster.wait_for(lambda: "ignored a Drained from kvbaton-both-0" in caplog.text, "the router to ignore Drained")
    cluster.send_and_count([drain])  # a captured Drain, replayed: refused
    first, second = cluster.router_frame(AbortRequests(["a"])), cluster.router_frame(AbortRequests(["b"]))
    cluster.commands.send(second)
    cluster.send_and_count([first])  # reordered: older than what the worker already took
    router_me = Peer(ROUTER_NAME, bytes.fromhex(cluster.launcher.specs[WORKER].router_session))
    stale = SequencedCodec(SECRET, FromWorker, router_me)
    stale.trust(Peer(WORKER, secrets.token_bytes(16)))  # an earlier (or another) worker of that name
    stale._seq = 2**40  # the newest frame the worker would have seen, were it addressed to this worker
    forger = SequencedCodec(b"not-the-cluster-secret-at-all", FromWorker, router_me)
    forger.trust(Peer(WORKER, cluster.worker_session()))
    cluster.send_and_count([stale.encode(Drain(), WORKER), forger.encode(Drain(), WORKER)])
    big = cluster.ctx.socket(zmq.PUSH)  # libzmq drops this connection at the size field: nothing to log
    big.connect(cluster.worker.address)
    before = cluster.refusals()
    big.send(b"x" * (MAX_CONTROL_FRAME_BYTES + 1))
    big.close(linger=1000)
    cluster.assert_serving()
    assert cluster.refusals() == before
    log = cluster.log.read_text()
    assert "replayed or reordered" in log and "addressed to" in log and "bad signature" in log


# ---- the router's event socket -----------------------------------------------------------------


def test_replayed_events_are_refused_by_the_router(cluster, caplog):
    caplog.set_level(logging.WARNING)
    tap = cluster.launcher.tap
    cluster.assert_serving()  # so the tap holds outputs of a real request
    handle, pid = cluster.worker, cluster.worker.pid
    session = cluster.worker_session()
    hello = next(f for f in tap.frames if isinstance(payload(f), WorkerHello))
    replays = [hello, tap.last(WorkerOutputs), tap.last(Heartbeat)]
    for frame in replays:
        cluster.events.send(frame)
    refused = lambda: caplog.text.count("router: refused a frame")  # noqa: E731
    cluster.wait_for(lambda: refused() >= len(replays), "the router's refusals")
    assert "replayed or reordered frame from kvbaton-both-0" in caplog.text
    assert cluster.worker is handle and handle.pid == pid and cluster.worker_session() == session
    cluster.assert_serving()  # no duplicated tokens: the stream still matches exactly
