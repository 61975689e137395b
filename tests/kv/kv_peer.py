"""A KV sender in its own process, for the cross-process connector tests.

    KVBATON_CLUSTER_SECRET=... [KVBATON_TEST_REDIS_URL=...] python -m tests.kv.kv_peer --transport shm \
        --address tcp://... --seed 3 --dtype bfloat16 --src 1,5,2 --dst 7,0,3 [--shared] [--layers N --then hang]

(from the repository root, or with it on PYTHONPATH: `tests.support.helpers.repo_python_env`).

Builds the pools `seeded_pools` makes (so the test can rebuild the expected rows), sends request
"x", and prints one JSON line per event: {"event": "ready"|"sent"|"done", ...}. It never outlives
--max-s, so a failed test cannot leave it behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

from kvbaton.kv.connectors import ConnectorConfig, PollResult, TransferSpec, make_sender
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import KVPools
from kvbaton.wire import SECRET_ENV
from tests.support.wait import wait_until

LAYERS, BLOCK, HEADS, DIM, BLOCKS = 4, 4, 2, 8, 48
REDIS_URL_ENV = "KVBATON_TEST_REDIS_URL"  # a secret (it holds the password): environment, not argv


def kv_layout(dtype: torch.dtype, head_dim: int = DIM) -> KVLayout:
    return KVLayout.standard(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=HEADS, head_dim=head_dim,
                             dtype=str(dtype).removeprefix("torch."))


def pool_shape(num_blocks: int = BLOCKS) -> tuple[int, int, int, int]:
    return (num_blocks * BLOCK, 2, HEADS, DIM)


def seeded_pools(seed: int, dtype: torch.dtype, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Random pools from `seed`, written into `out` (e.g. shared memory) when given."""
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randn(pool_shape(), generator=gen).to(dtype) for _ in range(LAYERS)]
    if out is None:
        return pools
    for dst, src in zip(out, pools):
        dst.copy_(src)
    return out


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--src", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("--shared", action="store_true", help="pools in shared memory (shm zero-copy)")
    p.add_argument("--layers", type=int, default=LAYERS, help="send only the first N layers")
    p.add_argument("--then", choices=("close", "hang"), default="close")
    p.add_argument("--max-s", type=float, default=30.0)
    args = p.parse_args()
    watchdog = threading.Timer(args.max_s, lambda: os._exit(3))  # never outlive a failed test
    watchdog.daemon = True
    watchdog.start()

    dtype = getattr(torch, args.dtype)
    layout = kv_layout(dtype)
    if args.shared:
        from kvbaton.kv.connectors.shm.segments import allocate_shared_pools

        pools = allocate_shared_pools(layout, BLOCKS, "kvpeer")
        seeded_pools(args.seed, dtype, out=pools.caches)
    else:
        pools = KVPools(layout, seeded_pools(args.seed, dtype))
    config = ConnectorConfig(args.transport, os.environ[SECRET_ENV].encode(), redis_url=os.environ.get(REDIS_URL_ENV),
                             worker_name="kvpeer", allow_insecure_transport=args.transport == "mooncake")
    sender = make_sender(config, pools)
    src = [int(b) for b in args.src.split(",")]
    dst = [int(b) for b in args.dst.split(",")]
    sender.begin(TransferSpec(request_id="x", src_block_ids=src, dst_block_ids=dst, receiver=args.address,
                              layout=layout, deadline_s=20.0))
    emit("ready", segment=pools.shared.name if pools.shared else None)
    for layer in range(args.layers):
        sender.save_layer(layer, ["x"])
    emit("sent", layers=args.layers)
    if args.then == "hang":
        time.sleep(args.max_s)  # noqa: TID251 - a sender that stalls mid-transfer is the behaviour under test

    def ended() -> PollResult | None:
        result = sender.poll()
        return result if result.completed or result.failed else None

    try:
        result = wait_until(ended, 20.0, interval_s=0.005, message="the transfer did not end")
        emit("done", completed=result.completed, failed=result.failed)
    except AssertionError:
        pass  # no "done" line: the test waiting for it reports the peer's silence
    sender.close()
    pools.close()  # unlinks a shared pool's segment
    sys.exit(0)


if __name__ == "__main__":
    main()
