"""KV transfer bandwidth between two processes, per transport, against this machine's own ceilings.

    .venv/bin/python benchmarks/bench_kv_transfer.py                        # shm (both pool kinds), tcp
    .venv/bin/python benchmarks/bench_kv_transfer.py --transports shm,tcp,redis --redis-url redis://...

The layout is the default model's (SmolLM2-135M: 30 layers, block 16, 3 KV heads, head_dim 64,
bf16), with random pools, no model. Each transfer moves `--mb` MB of blocks from a sender process
(this script, `--role sender`) into the receiver in this process, layer by layer as a prefill
would, through `make_sender`/`make_receiver`; time runs from the "go" to the receiver's poll()
reporting it complete. Baselines measured in the same run: one-thread memcpy (ctypes.memmove),
torch copy_ (all threads), the same scattered row copy in one process (what a shm receiver does),
and a plain ZeroMQ PUSH/PULL of the same frames between two processes over loopback TCP.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver, make_sender
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools, allocate_pools
from kvbaton.kv.rows import copy_rows
from kvbaton.wire import SECRET_ENV

LAYERS, BLOCK, HEADS, DIM = 30, 16, 3, 64
LAYOUT = KVLayout.standard(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16")
RESULTS = Path(__file__).parent / "results" / "kv-transfer.md"


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return LAYOUT.pool_shape(num_blocks)


def seeded_pools(seed: int, num_blocks: int, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pools = out or [torch.empty(pool_shape(num_blocks), dtype=torch.bfloat16) for _ in range(LAYERS)]
    for pool in pools:
        pool.copy_(torch.randn(pool_shape(num_blocks), generator=gen))
    return pools


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


# -- child roles ----------------------------------------------------------------------------------------


def run_sender(args: argparse.Namespace) -> None:
    """Send request after request on "go" lines from stdin, as a prefill worker would."""
    if args.shm_pool == "shared":
        from kvbaton.kv.connectors.shm.segments import allocate_shared_pools

        pools = allocate_shared_pools(LAYOUT, args.pool_blocks, "kvbench")
        seeded_pools(args.seed, args.pool_blocks, out=pools.caches)
    else:
        pools = KVPools(LAYOUT, seeded_pools(args.seed, args.pool_blocks))
    config = ConnectorConfig(args.transport, os.environ[SECRET_ENV].encode(), redis_url=args.redis_url,
                             worker_name="kvbench-prefill")
    sender = make_sender(config, pools)
    emit("ready", zero_copy=getattr(sender, "zero_copy", None))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        emit("done", **_send_one(sender, LAYOUT, cmd))
    sender.close()
    pools.close()  # unlinks a shared pool's segment


def _send_one(sender, layout: KVLayout, cmd: dict) -> dict:
    t0 = time.perf_counter()
    sender.begin(TransferSpec(request_id=cmd["id"], src_block_ids=cmd["src"], dst_block_ids=cmd["dst"],
                                 receiver=cmd["address"], layout=layout, deadline_s=60.0))
    in_save = 0.0
    for layer in range(LAYERS):
        s = time.perf_counter()
        sender.save_layer(layer, [cmd["id"]])
        in_save += time.perf_counter() - s
    while True:
        result = sender.poll()
        if result.completed or result.failed:
            return {"id": cmd["id"], "ok": bool(result.completed), "failed": result.failed,
                    "sender_s": time.perf_counter() - t0, "save_layer_us": in_save / LAYERS * 1e6}
        time.sleep(0.0002)


def run_pusher(args: argparse.Namespace) -> None:
    """Baseline: push LAYERS frames of the same size over plain ZeroMQ on each "go"."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(args.address)
    frame = bytearray(os.urandom(args.frame_bytes))
    emit("ready")
    for line in sys.stdin:
        if json.loads(line)["op"] == "stop":
            break
        for _ in range(LAYERS):
            sock.send(frame, copy=False)
    sock.close(linger=5000)
    ctx.term()


# -- the parent -----------------------------------------------------------------------------------------


class Child:
    """This script in another role; JSON events on stdout, commands on stdin."""

    def __init__(self, *args: str, secret: bytes) -> None:
        env = {**os.environ, SECRET_ENV: secret.decode()}
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        self.events: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.events.append(json.loads(line))
                self._cv.notify_all()

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next(self, event: str, timeout_s: float = 120.0) -> dict:
        with self._cv:
            ok = self._cv.wait_for(lambda: any(e["event"] == event for e in self.events), timeout_s)
            if not ok:
                raise RuntimeError(f"no {event!r} from the child within {timeout_s}s (exit {self.proc.poll()})")
            found = next(e for e in self.events if e["event"] == event)
            self.events.remove(found)
            return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="stop")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class Row:
    name: str
    gbps: list[float]
    baseline: str
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.gbps)


def best_of(fn, repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def memcpy_baselines(nbytes: int, src_ids: list[int], dst_ids: list[int], pool_blocks: int,
                     repeats: int) -> dict[str, list[float]]:
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    b = torch.zeros_like(a)
    src = seeded_pools(1, pool_blocks)
    dst = [torch.zeros_like(p) for p in src]
    row = LAYOUT.block_bytes

    def scattered() -> None:
        for s, d in zip(src, dst):
            copy_rows(d.data_ptr(), dst_ids, s.data_ptr(), src_ids, row)

    return {
        "memcpy": best_of(lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), nbytes), repeats),
        "torch": best_of(lambda: b.copy_(a), repeats),
        "scattered": best_of(scattered, repeats),
    }


def loopback_zmq(nbytes: int, secret: bytes, repeats: int, warmup: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = Child("--role", "pusher", "--address", f"tcp://127.0.0.1:{port}",
                  "--frame-bytes", str(nbytes // LAYERS), secret=secret)
    try:
        child.next("ready")
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            child.send(op="go")
            for _ in range(LAYERS):
                sock.recv(copy=False)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        child.stop()
        sock.close(linger=0)
        ctx.term()


def bench_transport(transport: str, shm_pool: str, src_ids: list[int], dst_ids: list[int],
                    args: argparse.Namespace, secret: bytes) -> tuple[list[float], dict]:
    dst = allocate_pools(LAYOUT, args.pool_blocks)
    dst_pools = dst.caches
    config = ConnectorConfig(transport, secret, redis_url=args.redis_url, worker_name="kvbench-decode")
    receiver = make_receiver(config, dst)
    child = Child("--role", "sender", "--transport", transport, "--shm-pool", shm_pool, "--seed", str(args.seed),
                  "--pool-blocks", str(args.pool_blocks), *(["--redis-url", args.redis_url] if args.redis_url else []),
                  secret=secret)
    try:
        ready = child.next("ready")
        times, polls, sides = [], [], []
        for i in range(args.warmup + args.repeats):
            rid = f"{transport}-{shm_pool}-{i}"
            receiver.expect(rid, dst_ids, 60.0)
            t0 = time.perf_counter()
            child.send(op="go", id=rid, src=src_ids, dst=dst_ids, address=receiver.address)
            in_poll = _wait_completed(receiver, rid)
            elapsed = time.perf_counter() - t0
            done = child.next("done")
            if not done["ok"]:
                raise RuntimeError(f"{transport}: sender reports {done['failed']}")
            if i >= args.warmup:
                times.append(elapsed)
                polls.append(in_poll)
                sides.append(done)
        expected = seeded_pools(args.seed, args.pool_blocks)
        for layer in range(LAYERS):
            got, want = (p.view(args.pool_blocks, -1) for p in (dst_pools[layer], expected[layer]))
            if not torch.equal(got[dst_ids], want[src_ids]):
                raise RuntimeError(f"{transport}: layer {layer} differs after the transfer")
        info = {"zero_copy": ready.get("zero_copy"), "poll_ms": statistics.median(polls) * 1e3,
                "save_layer_us": statistics.median(d["save_layer_us"] for d in sides)}
        return times, info
    finally:
        child.stop()
        receiver.close()


def _wait_completed(receiver, rid: str) -> float:
    """Poll as a decode worker's loop would; returns the time spent inside poll() (the engine thread's cost)."""
    in_poll, deadline = 0.0, time.monotonic() + 60.0
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        result = receiver.poll()
        in_poll += time.perf_counter() - t0
        if result.failed:
            raise RuntimeError(f"receiver reports {result.failed}")
        if rid in result.completed:
            return in_poll
        time.sleep(0.0002)
    raise RuntimeError(f"{rid} did not complete within 60s")


def block_ids(order: str, count: int, pool_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    if order == "contiguous":
        return list(range(count)), list(range(pool_blocks - count, pool_blocks))
    rng = random.Random(seed)
    return rng.sample(range(pool_blocks), count), rng.sample(range(pool_blocks), count)


def gbps(nbytes: int, times: list[float]) -> list[float]:
    return [nbytes / t / 1e9 for t in times]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="shm,tcp", help="comma list of kvbaton.kv.connectors.TRANSPORTS")
    p.add_argument("--shm-pool", default="both", choices=("shared", "plain", "both"),
                   help="shm sender pool: shared memory (zero-copy), plain tensors (staged), or both")
    p.add_argument("--mb", type=float, default=64.0, help="KV moved per transfer, MB (all layers)")
    p.add_argument("--orders", default="random,contiguous", help="block id orders: random, contiguous")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--role", default="bench", choices=("bench", "sender", "pusher"), help=argparse.SUPPRESS)
    p.add_argument("--transport", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--pool-blocks", type=int, help=argparse.SUPPRESS)
    p.add_argument("--frame-bytes", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.role == "sender":
        return run_sender(args)
    if args.role == "pusher":
        return run_pusher(args)
    run_all(args)


def variants(transports: list[str], shm_pool: str) -> list[tuple[str, str, str]]:
    """(label, transport, shm pool kind) for each measured variant."""
    out = []
    for transport in transports:
        if transport != "shm":
            out.append((transport, transport, "plain"))
            continue
        for kind in (("shared", "plain") if shm_pool == "both" else (shm_pool,)):
            out.append((f"shm ({'zero-copy' if kind == 'shared' else 'staged'})", "shm", kind))
    return out


def run_all(args: argparse.Namespace) -> None:
    secret = secrets.token_hex(32).encode()
    per_block = LAYOUT.bytes_per_block  # bytes of one block, all layers (bf16)
    count = max(1, round(args.mb * 1e6 / per_block))
    nbytes = count * per_block
    args.pool_blocks = 2 * count + 8
    load_before = os.getloadavg()
    print(f"{count} blocks x {LAYERS} layers = {nbytes / 1e6:.1f} MB per transfer; pools of {args.pool_blocks} blocks")
    baselines: dict[str, Row] = {}
    mem = memcpy_baselines(nbytes, *block_ids("random", count, args.pool_blocks, args.seed), args.pool_blocks,
                           args.repeats)
    baselines["memcpy"] = Row("memcpy, one thread (ctypes.memmove, contiguous)", gbps(nbytes, mem["memcpy"]), "")
    baselines["torch"] = Row("torch copy_ (all threads, contiguous)", gbps(nbytes, mem["torch"]), "")
    baselines["scattered"] = Row("scattered row copy in one process (random ids; a shm receiver's work)",
                                 gbps(nbytes, mem["scattered"]), "")
    baselines["zmq"] = Row(f"ZeroMQ PUSH/PULL over loopback TCP, 2 processes, {LAYERS} frames of "
                           f"{nbytes // LAYERS / 1e6:.2f} MB", gbps(nbytes, loopback_zmq(nbytes, secret, args.repeats,
                                                                                         args.warmup)), "")
    for key, row in baselines.items():
        print(f"baseline {key:10s} median {row.median:6.2f} GB/s")
    rows = []
    for order in args.orders.split(","):
        src, dst = block_ids(order, count, args.pool_blocks, args.seed)
        for label, transport, kind in variants(args.transports.split(","), args.shm_pool):
            times, info = bench_transport(transport, kind, src, dst, args, secret)
            base = "memcpy" if transport == "shm" else "zmq"
            note = f"{info['poll_ms']:.1f} | {info['save_layer_us']:.0f}"
            rows.append((order, Row(label, gbps(nbytes, times), base, note)))
            print(f"{order:10s} {label:18s} median {rows[-1][1].median:6.2f} GB/s "
                  f"({rows[-1][1].median / baselines[base].median:.0%} of {base}); poll ms | save_layer us: {note}")
    write_report(args, nbytes, count, baselines, rows, load_before, os.getloadavg())


def write_report(args: argparse.Namespace, nbytes: int, count: int, baselines: dict[str, Row],
                 rows: list[tuple[str, Row]], load_before: tuple, load_after: tuple) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    command = " ".join([".venv/bin/python", "benchmarks/bench_kv_transfer.py", *sys.argv[1:]])
    lines = [
        "# KV transfer bandwidth between two processes", "",
        f"Command: `{command}`", "",
        f"Run {time.strftime('%Y-%m-%d %H:%M:%S %Z')} on {cpu}, {os.cpu_count()} cores; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (other people's jobs share this machine); "
        f"Python {platform.python_version()}, torch {torch.__version__}, pyzmq {zmq.__version__}.", "",
        f"Layout of the default model: {LAYERS} layers, block {BLOCK}, {HEADS} KV heads, head_dim {DIM}, bf16 "
        f"({LAYOUT.block_bytes} B per block per layer). Each transfer: {count} blocks x {LAYERS} layers = "
        f"{nbytes / 1e6:.1f} MB, sent layer by layer from a sender process into this process's pool; "
        f"{args.warmup} warm-up transfers, then {args.repeats} timed. GB/s = 1e9 bytes/s; medians, best in brackets.",
        "", "## Baselines (same run)", "", "| baseline | GB/s |", "|---|---|",
        *[f"| {row.name} | {row.median:.2f} ({max(row.gbps):.2f}) |" for row in baselines.values()],
        "", "## Transports", "",
        "| block ids | transport | GB/s | vs baseline | receiver poll() ms per transfer | sender save_layer µs |",
        "|---|---|---|---|---|---|",
    ]
    for order, row in rows:
        base = baselines[row.baseline]
        lines.append(f"| {order} | {row.name} | {row.median:.2f} ({max(row.gbps):.2f}) | "
                     f"{row.median / base.median:.0%} of {row.baseline} | {row.note} |")
    lines += ["", "Baselines: shm against one-thread memcpy (the receiver copies on one thread); network "
              "transports against plain ZeroMQ over loopback. `receiver poll() ms` is the time the decode "
              "worker's engine thread spends inside poll() per transfer (the copy into its pool); "
              "`save_layer µs` the prefill engine thread's cost per layer.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
