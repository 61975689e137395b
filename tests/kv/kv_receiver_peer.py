"""A KV receiver in its own process, for the redis and mooncake cross-process tests, plus the
helpers those tests share.

    KVBATON_CLUSTER_SECRET=... [KVBATON_TEST_REDIS_URL=...] \
        python -m tests.kv.kv_receiver_peer --transport redis --dtypes bfloat16,float32 --dst 7,0,3

One receiver per dtype expects request "x-<dtype>" into `--dst`; prints {"event": "ready",
"addresses": {dtype: address}}, then, once every one is reported, {"event": "done", dtype:
{"completed", "failed", "digests" (sha256 of the dst rows, per layer), "others_zero"}}. One
process for both dtypes: a process start (importing torch) is the slow part. A watchdog ends
it after --max-s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from kvbaton.kv.connectors import ConnectorConfig, PollResult, make_receiver
from kvbaton.kv.pools import KVPools, block_view
from kvbaton.wire import SECRET_ENV
from tests.kv.kv_peer import BLOCK, BLOCKS, DIM, HEADS, LAYERS, REDIS_URL_ENV, kv_layout
from tests.support.procs import repo_python_env
from tests.support.wait import wait_until


def pools(dtype: torch.dtype, seed: int | None = None) -> list[torch.Tensor]:
    """Random pools from `seed`, or zeros."""
    shape = (BLOCKS * BLOCK, 2, HEADS, DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]


def rows(pools: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    layout = kv_layout(pools[0].dtype)
    return [block_view(p, layout)[block_ids] for p in pools]


def digests(pools: list[torch.Tensor], block_ids: list[int]) -> list[str]:
    return [hashlib.sha256(r.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for r in rows(pools, block_ids)]


def others_zero(pools: list[torch.Tensor], block_ids: list[int]) -> bool:
    """Every row outside `block_ids` is still zero: nothing was written where it should not be."""
    keep = torch.ones(BLOCKS, dtype=torch.bool)
    keep[block_ids] = False
    return all(not r.any() for r in rows(pools, keep.nonzero().flatten().tolist()))


@dataclass
class Outcome:
    completed: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, result: PollResult) -> None:
        self.completed.update(result.completed)
        self.failed.update(result.failed)

    def ended(self, request_id: str) -> bool:
        return request_id in self.completed or request_id in self.failed


def poll_until(sides: list, until, timeout_s: float = 10.0, outcomes: list[Outcome] | None = None) -> list[Outcome]:
    """Poll every connector in `sides` until `until(*outcomes)`; a bounded wait."""
    outcomes = outcomes or [Outcome() for _ in sides]

    def done() -> bool:
        for side, outcome in zip(sides, outcomes):
            outcome.add(side.poll())
        return until(*outcomes)

    wait_until(done, timeout_s, interval_s=0.005, message=lambda: f"not done: {outcomes}")
    return outcomes


def poll_for(sides: list, seconds: float) -> list[Outcome]:
    """Poll for a while and return whatever was reported (for "nothing happens" checks)."""
    outcomes = [Outcome() for _ in sides]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for side, outcome in zip(sides, outcomes):
            outcome.add(side.poll())
        time.sleep(0.005)  # noqa: TID251 - watching a fixed window for what must NOT happen: the window is the check
    return outcomes


def spawn(transport: str, dtypes: list[str], dst: list[int], env: dict[str, str]) -> subprocess.Popen:
    """Start this module as a receiver process; the caller stops it by PID (`proc.kill()`)."""
    cmd = [sys.executable, "-m", "tests.kv.kv_receiver_peer", "--transport", transport, "--dtypes", ",".join(dtypes),
           "--dst", ",".join(map(str, dst))]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=repo_python_env(env))


def read_event(proc: subprocess.Popen, timeout_s: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise AssertionError(f"peer {proc.pid} said nothing within {timeout_s} s (exit code {proc.poll()})")
    return json.loads(line)


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", required=True)
    p.add_argument("--dtypes", default="bfloat16", help="one receiver (and request 'x-<dtype>') per dtype")
    p.add_argument("--dst", required=True)
    p.add_argument("--deadline-s", type=float, default=20.0)
    p.add_argument("--max-s", type=float, default=40.0)
    args = p.parse_args()
    watchdog = threading.Timer(args.max_s, lambda: os._exit(3))  # never outlive a failed test
    watchdog.daemon = True
    watchdog.start()

    config = ConnectorConfig(args.transport, os.environ[SECRET_ENV].encode(), redis_url=os.environ.get(REDIS_URL_ENV),
                             worker_name="kvpeer-recv", allow_insecure_transport=args.transport == "mooncake")
    dst = [int(b) for b in args.dst.split(",")]
    receivers, kvs = {}, {}
    for dtype in args.dtypes.split(","):
        kvs[dtype] = pools(getattr(torch, dtype))
        receivers[dtype] = make_receiver(config, KVPools(kv_layout(getattr(torch, dtype)), kvs[dtype]))
        receivers[dtype].expect(f"x-{dtype}", dst, args.deadline_s)
    emit("ready", addresses={d: r.address for d, r in receivers.items()}, pid=os.getpid())
    outcomes = poll_until(list(receivers.values()), lambda *o: all(x.completed or x.failed for x in o),
                          args.deadline_s + 5.0)
    emit("done", **{d: {"completed": sorted(o.completed), "failed": sorted(o.failed.items()),
                        "digests": digests(kvs[d], dst), "others_zero": others_zero(kvs[d], dst)}
                    for d, o in zip(receivers, outcomes)})
    for receiver in receivers.values():
        receiver.close()


if __name__ == "__main__":
    main()
