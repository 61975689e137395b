"""What `kvbaton serve --encrypt-traffic` (ZeroMQ CURVE) costs per frame, over tcp://127.0.0.1.

    .venv/bin/python benchmarks/curve_overhead.py [--seconds 1.0]

Two frames: a typical router-bound `WorkerOutputs` (a decode step of 32 requests, one token each,
signed and sequenced as the worker sends it) and one 256 KiB KV layer frame (the tcp transport's
data frame). For each, plain and CURVE: the round trip of one frame (PAIR ping-pong with an echo
thread; median), and the throughput of a PUSH -> PULL stream (frames/s while the window lasts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid

import zmq

from common.machine import cpu_name
from kvbaton.messages.router_worker import WorkerLoad, WorkerOutputs
from kvbaton.messages.worker_spec import ROUTER_NAME
from kvbaton.sched.info import EngineStats
from kvbaton.sched.outputs import EngineCoreOutput
from kvbaton.wire import CurveKeys, Peer, SequencedCodec, curve_client, curve_keys, curve_server

SECRET = os.urandom(32).hex().encode()
KV_FRAME_BYTES = 256 * 1024


def outputs_frame(num_requests: int = 32) -> bytes:
    outputs = [EngineCoreOutput(request_id=f"cmpl-{uuid.uuid4().hex}", new_token_ids=[1000 + i])
               for i in range(num_requests)]
    load = WorkerLoad(EngineStats(num_running=num_requests, kv_cache_usage=0.4, kv_slots_allocated=9000), 0, 0, 7)
    codec = SequencedCodec(SECRET, WorkerOutputs, Peer.fresh("kvbaton-decode-0"))
    codec.trust(Peer.fresh(ROUTER_NAME))
    return codec.encode(WorkerOutputs("kvbaton-decode-0", outputs, load), ROUTER_NAME)


def pair(ctx: zmq.Context, kind_server: int, kind_client: int, keys: CurveKeys | None) -> tuple[zmq.Socket, zmq.Socket]:
    server, client = ctx.socket(kind_server), ctx.socket(kind_client)
    for sock in (server, client):
        sock.setsockopt(zmq.LINGER, 0)
    curve_server(server, keys)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    curve_client(client, keys)
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


def round_trip_us(ctx: zmq.Context, frame: bytes, keys: CurveKeys | None, seconds: float) -> float:
    server, client = pair(ctx, zmq.PAIR, zmq.PAIR, keys)

    def echo() -> None:
        while (msg := server.recv(copy=False)).bytes != b"stop":
            server.send(msg, copy=False)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client.send(frame)
    client.recv()  # the handshake is not part of a frame's cost
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        client.send(frame, copy=False)
        client.recv(copy=False)
        samples.append(time.perf_counter() - start)
    client.send(b"stop")
    thread.join(5)
    server.close()
    client.close()
    return statistics.median(samples) * 1e6


def throughput(ctx: zmq.Context, frame: bytes, keys: CurveKeys | None, seconds: float) -> float:
    """Frames per second through one PUSH -> PULL connection."""
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH, keys)
    push.send(frame)
    pull.recv()  # handshake done
    received = 0
    done = threading.Event()

    def drain() -> None:
        nonlocal received
        while not done.is_set() or pull.poll(0):
            if pull.poll(50):
                pull.recv(copy=False)
                received += 1

    thread = threading.Thread(target=drain, daemon=True)
    start = time.perf_counter()
    thread.start()
    while time.perf_counter() - start < seconds:
        for _ in range(64):
            push.send(frame, copy=False)
    done.set()
    thread.join(60)
    elapsed = time.perf_counter() - start
    pull.close()
    push.close()
    return received / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement (default 1.0)")
    args = parser.parse_args()
    if not zmq.has("curve"):
        parser.exit(2, "curve_overhead: this libzmq has no CURVE\n")
    keys = curve_keys(SECRET, True)
    frames = {"WorkerOutputs (32 requests)": outputs_frame(), "KV layer frame": os.urandom(KV_FRAME_BYTES)}
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}")
    print(f"{'frame':<28} {'bytes':>8} {'RTT plain':>10} {'RTT curve':>10} {'ratio':>6} "
          f"{'plain/s':>9} {'curve/s':>9} {'ratio':>6} {'curve MB/s':>10}")
    ctx = zmq.Context()
    try:
        for name, frame in frames.items():
            rtt = [round_trip_us(ctx, frame, k, args.seconds) for k in (None, keys)]
            rate = [throughput(ctx, frame, k, args.seconds) for k in (None, keys)]
            print(f"{name:<28} {len(frame):>8} {rtt[0]:>8.1f}us {rtt[1]:>8.1f}us {rtt[1] / rtt[0]:>6.2f} "
                  f"{rate[0]:>9.0f} {rate[1]:>9.0f} {rate[0] / rate[1]:>6.2f} {rate[1] * len(frame) / 1e6:>10.0f}")
    finally:
        ctx.destroy(linger=0)
    print("ratio = CURVE / plain for round trips (time), plain / CURVE for throughput (how many times slower)")


if __name__ == "__main__":
    main()
