"""Sender/receiver pairs of every KV transport, built one way for every test under tests/kv (the `make_pair`
fixture of tests/kv/conftest.py), and what a test may do to each transport's medium beside its connectors.

Variants (`VARIANTS`): "tcp"; "shm" (plain pools: the sender stages each transfer); "shm-shared" (the sender's
pools come from `pool_allocator`: zero-copy); "redis" (the module's private redis-server, the `server` fixture of
tests/kv/conftest.py, started only when a test asks for a redis pair); "mooncake" (Mooncake Transfer Engines over
tcp, P2P handshake). Everything talks to 127.0.0.1 only, and everything a factory made is closed after the test.

A `Medium` is the transport's channel as a test sees it: inject raw messages into a receiver, forge messages about a
request, list what the transport still holds for a request outside both pools, stand up receivers that never answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvbaton.kv.connectors import (
    ConnectorConfig,
    KVReceiver,
    KVSender,
    TransferSpec,
    make_receiver,
    make_sender,
    pool_allocator,
)
from kvbaton.kv.connectors.shm.segments import SHM_DIR
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools, allocate_pools
from kvbaton.wire import SECRET_ENV, SignedCodec
from tests.kv.kv_peer import BLOCKS, DIM, LAYERS, REDIS_URL_ENV, kv_layout, seeded_pools
from tests.support.procs import repo_python_env
from tests.support.wait import wait_until

SECRET = b"kvbaton-test-secret-0123456789ab"
STRANGER = b"another-cluster-secret-0123"  # signs what a peer of another cluster (or an attacker) sends
VARIANTS = ["tcp", "shm", "shm-shared", "redis", "mooncake"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
REDIS_TTL_S = 30
SENDER_PEER = "tests.kv.kv_peer"  # run with `python -m`, the repository root on PYTHONPATH


def transport_of(variant: str) -> str:
    return variant.split("-")[0]


# ---- polling ---------------------------------------------------------------------------------------------------


@dataclass
class Log:
    completed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, result) -> None:
        self.completed += result.completed
        self.failed.update(result.failed)

    def ended(self, request_id: str) -> bool:
        return request_id in self.completed or request_id in self.failed


def pump(sender: KVSender | None, receiver: KVReceiver | None, until: Callable[[Log, Log], bool],
         timeout_s: float = 10.0, logs: tuple[Log, Log] | None = None) -> tuple[Log, Log]:
    """Poll both sides until `until(receiver_log, sender_log)`, for at most `timeout_s`; `logs` carries on
    from an earlier pump's (receiver, sender) logs."""
    rlog, slog = logs or (Log(), Log())

    def polled() -> bool:
        if receiver is not None:
            rlog.add(receiver.poll())
        if sender is not None:
            slog.add(sender.poll())
        return until(rlog, slog)

    if not until(rlog, slog):
        wait_until(polled, timeout_s, interval_s=0.002, message=lambda: f"timed out: receiver {rlog}, sender {slog}")
    return rlog, slog


def watch(sender: KVSender | None, receiver: KVReceiver | None, seconds: float) -> tuple[Log, Log]:
    """Poll both sides for `seconds` and return what they reported (for "nothing happens" checks)."""
    rlog, slog = Log(), Log()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if receiver is not None:
            rlog.add(receiver.poll())
        if sender is not None:
            slog.add(sender.poll())
        time.sleep(0.005)  # noqa: TID251 - watching a fixed window for what must NOT happen: the window is the check
    return rlog, slog


# ---- blocks and pools ------------------------------------------------------------------------------------------


def rows(pools: list[torch.Tensor], layer: int, ids: list[int]) -> torch.Tensor:
    return pools[layer].view(BLOCKS, -1)[ids]


def random_ids(rng, *sizes: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[list[int]]:
    """Disjoint random block-id lists (none of them in `exclude`)."""
    ids = rng.sample([b for b in range(BLOCKS) if b not in exclude], sum(sizes))
    return [ids[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]


def my_segments(kind: str = "", pid: int | None = None) -> list[str]:
    mark = f"-{pid or os.getpid()}-{kind}"
    return [name for name in os.listdir(SHM_DIR) if name.startswith("kvb-") and mark in name]


# ---- pairs -----------------------------------------------------------------------------------------------------


@dataclass
class Pair:
    variant: str
    sender: KVSender
    receiver: KVReceiver
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    medium: Medium

    @property
    def transport(self) -> str:
        return transport_of(self.variant)

    def spec(self, request_id: str, src: list[int], dst: list[int], deadline_s: float = 10.0,
             layout: KVLayout | None = None) -> TransferSpec:
        return TransferSpec(request_id=request_id, src_block_ids=src, dst_block_ids=dst, receiver=self.receiver.address,
                            layout=layout or self.receiver.layout, deadline_s=deadline_s)

    def send_all(self, request_id: str, src: list[int], dst: list[int], deadline_s: float = 10.0) -> None:
        self.sender.begin(self.spec(request_id, src, dst, deadline_s))
        for layer in range(LAYERS):
            self.sender.save_layer(layer, [request_id])


class PairFactory:
    """`make_pair(variant, dtype, seed, recv_dim)` -> Pair: src pools seeded (`seeded_pools(seed)`), dst pools zeros
    of head_dim `recv_dim`. `sender(...)`, `receiver(...)` make one side alone; `peer_env(variant)` is what a peer
    process (kv_peer, kv_receiver_peer) needs. Everything made is closed by `close()` (the fixture's teardown)."""

    def __init__(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
        self._request, self._monkeypatch = request, monkeypatch
        self._closers: list[Callable[[], None]] = []
        self._media: dict[str, Medium] = {}

    def _redis_url(self) -> str:
        return self._request.getfixturevalue("server").url  # the module's private redis-server

    def config(self, variant: str) -> ConnectorConfig:
        transport = transport_of(variant)
        if transport == "mooncake":
            from kvbaton.kv.connectors.mooncake.engine import PROTOCOL_ENV

            self._monkeypatch.setenv(PROTOCOL_ENV, "tcp")
        url = self._redis_url() if transport == "redis" else None
        return ConnectorConfig(transport, SECRET, worker_name="kvtest", redis_url=url, redis_ttl_s=REDIS_TTL_S,
                               allow_insecure_transport=transport == "mooncake")  # it listens on every interface

    def peer_env(self, variant: str) -> dict[str, str]:
        env = {SECRET_ENV: SECRET.decode()}
        if transport_of(variant) == "redis":
            env[REDIS_URL_ENV] = self._redis_url()
        if transport_of(variant) == "mooncake":
            from kvbaton.kv.connectors.mooncake.engine import PROTOCOL_ENV

            env[PROTOCOL_ENV] = "tcp"
        return env

    def medium(self, variant: str) -> Medium:
        transport = transport_of(variant)
        if transport not in self._media:
            self._media[transport] = MEDIA[transport](self)
            self._closers.append(self._media[transport].close)
        return self._media[transport]

    def sender(self, variant: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> KVSender:
        config = self.config(variant)
        if variant == "shm-shared":  # what a shm prefill worker allocates: pools in shared memory
            src = pool_allocator(config, sending=True)(kv_layout(dtype), BLOCKS)
            seeded_pools(seed, dtype, out=src.caches)
        else:
            src = KVPools(kv_layout(dtype), seeded_pools(seed, dtype))
        sender = make_sender(config, src)
        self._closers += [sender.close, src.close]
        return sender

    def receiver(self, variant: str, dtype: torch.dtype = torch.bfloat16, head_dim: int = DIM) -> KVReceiver:
        receiver = make_receiver(self.config(variant), allocate_pools(kv_layout(dtype, head_dim=head_dim), BLOCKS))
        self._closers.append(receiver.close)
        return receiver

    def __call__(self, variant: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, recv_dim: int = DIM) -> Pair:
        receiver = self.receiver(variant, dtype, recv_dim)  # zeros
        sender = self.sender(variant, dtype, seed)
        return Pair(variant, sender, receiver, sender.pools.caches, receiver.pools.caches, self.medium(variant))

    def close(self) -> None:
        # the order they were made in: a sender before its pools, every connector before the medium it used
        for close in self._closers:
            close()
        self._closers.clear()


# ---- media -----------------------------------------------------------------------------------------------------


def signed_three_ways(message: msgspec.Struct) -> list[bytes]:
    """`message` unsigned, with an all-zero signature, and signed with another cluster's secret: all refused."""
    unsigned = msgspec.msgpack.encode(message)
    return [unsigned, b"\0" * 32 + unsigned, SignedCodec(STRANGER, object).encode(message)]


class Medium(ABC):
    """A transport's channel as a test sees it."""

    def __init__(self, factory: PairFactory) -> None:
        self.factory = factory

    @abstractmethod
    def inject(self, address: str, messages: list[list[bytes]]) -> None:
        """Deliver raw `messages` (each a list of frames) to the receiver at `address`, in order."""

    @abstractmethod
    def forgeries(self, pair: Pair, request_id: str, src: list[int], dst: list[int]) -> list[list[bytes]]:
        """Messages about `request_id` that would move KV if the receiver believed them: unsigned, zero-signed and
        signed with another cluster's secret."""

    def leftovers(self, *request_ids: str) -> list:
        """What the transport still holds for these requests outside both pools (nothing, for a transport
        that stores nothing)."""
        return []

    @abstractmethod
    def silent_receivers(self) -> AbstractContextManager[list[str]]:
        """Receiver addresses at which nothing ever answers (a context: they go when it ends)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the medium holds (sockets, clients)."""


class ZmqMedium(Medium):
    """tcp, shm and mooncake: a receiver is a ZeroMQ socket (PULL for tcp/shm, ROUTER for mooncake)."""

    attacker_type = zmq.PUSH
    deaf_type = zmq.PULL

    def __init__(self, factory: PairFactory) -> None:
        super().__init__(factory)
        self._ctx = zmq.Context()  # kept until the test ends: what was injected is delivered, not dropped

    def inject(self, address: str, messages: list[list[bytes]]) -> None:
        attacker = self._ctx.socket(self.attacker_type)
        attacker.connect(address)
        for message in messages:
            attacker.send_multipart(message)

    @contextmanager
    def silent_receivers(self) -> Iterator[list[str]]:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            unreachable = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        deaf = self._ctx.socket(self.deaf_type)  # a receiver's socket that never reads, never answers
        deaf.setsockopt(zmq.LINGER, 0)
        port = deaf.bind_to_random_port("tcp://127.0.0.1")
        try:
            yield [unreachable, f"tcp://127.0.0.1:{port}"]
        finally:
            deaf.close()

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class TcpMedium(ZmqMedium):
    def forgeries(self, pair: Pair, request_id: str, src: list[int], dst: list[int]) -> list[list[bytes]]:
        from kvbaton.kv.connectors.tcp import TcpLayer

        layout = pair.sender.layout
        header = TcpLayer(request_id, 0, layout, pair.sender.ack_address, len(dst), b"\0" * 32)
        data = bytes(len(dst) * layout.block_bytes)
        return [[frame, data] for frame in signed_three_ways(header)]


class ShmMedium(ZmqMedium):
    def forgeries(self, pair: Pair, request_id: str, src: list[int], dst: list[int]) -> list[list[bytes]]:
        from kvbaton.kv.connectors.shm import ShmLayer

        header = ShmLayer(request_id, 0, pair.sender.layout, pair.sender.ack_address, os.getpid(), "kvb-forged", 0,
                          list(range(len(dst))), False)
        return [[frame] for frame in signed_three_ways(header)]


class MooncakeMedium(ZmqMedium):
    attacker_type = zmq.DEALER
    deaf_type = zmq.ROUTER

    def forgeries(self, pair: Pair, request_id: str, src: list[int], dst: list[int]) -> list[list[bytes]]:
        from kvbaton.kv.connectors.mooncake import LayerReady, Offer

        offer = Offer(request_id, "127.0.0.1:1", pair.sender.layout, BLOCKS, [0] * LAYERS, src, dst)
        layer = SignedCodec(STRANGER, object).encode(LayerReady([request_id], 0))
        return [*([frame] for frame in signed_three_ways(offer)), [layer]]


class RedisMedium(Medium):
    """redis: a receiver is a notification list in the store; the layers wait under keys of their own."""

    def __init__(self, factory: PairFactory) -> None:
        import redis

        super().__init__(factory)
        self.store = redis.Redis.from_url(factory._redis_url())

    def inject(self, address: str, messages: list[list[bytes]]) -> None:
        # a list holds single frames: each part of a message is a frame of its own
        self.store.rpush(address, *(frame for message in messages for frame in message))

    def forgeries(self, pair: Pair, request_id: str, src: list[int], dst: list[int]) -> list[list[bytes]]:
        from kvbaton.kv.connectors.redis import KEY_PREFIX, LayerStored, dst_digest

        layout = pair.sender.layout
        payload = bytes(len(dst) * layout.block_bytes)
        notice = LayerStored(request_id, "forged", dst_digest(dst), 0, LAYERS, f"{KEY_PREFIX}{request_id}:forged:0",
                             len(payload), hashlib.sha256(payload).digest(), layout.dtype)
        return [[frame] for frame in signed_three_ways(notice)]

    def leftovers(self, *request_ids: str) -> list:
        from kvbaton.kv.connectors.redis import KEY_PREFIX

        return sorted(key for rid in request_ids for key in self.store.scan_iter(match=f"{KEY_PREFIX}{rid}:*"))

    @contextmanager
    def silent_receivers(self) -> Iterator[list[str]]:
        parked = f"kvbaton:kvq:parked:{secrets.token_hex(4)}"  # a notification list nobody reads
        try:
            yield [parked]
        finally:
            self.store.delete(parked)

    def close(self) -> None:
        self.store.close()


MEDIA: dict[str, type[Medium]] = {"tcp": TcpMedium, "shm": ShmMedium, "mooncake": MooncakeMedium,
                                  "redis": RedisMedium}


# ---- a sender in another process -------------------------------------------------------------------------------


class SenderPeer:
    """kv_peer.py in a subprocess; its stdout events are read on a thread so waits stay bounded."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str) -> None:
        self.stderr_path = tmp_path / "peer.err"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", SENDER_PEER, *args], stdout=subprocess.PIPE,
                                         stderr=err, env=repo_python_env(env), text=True)
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def event(self, name: str, timeout_s: float = 30.0) -> dict:
        def found() -> dict | None:
            first = next((e for e in self.events if e["event"] == name), None)
            if first is None:
                assert self.proc.poll() is None or self.events, f"peer exited: {self.stderr_path.read_text()}"
            return first

        return wait_until(found, timeout_s, interval_s=0.01,
                          message=lambda: f"no {name!r} from the peer: {self.stderr_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def sender_peer_args(transport: str, address: str, seed: int, src: list[int], dst: list[int], *extra: str) -> list[str]:
    return ["--transport", transport, "--address", address, "--seed", str(seed),
            "--src", ",".join(map(str, src)), "--dst", ",".join(map(str, dst)), *extra]
