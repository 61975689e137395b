"""One expert worker of an AFD expert pool without a router, for tests, benchmarks and experiments by hand:

    KVBATON_CLUSTER_SECRET=... python -m kvbaton.parallel.afd.standalone '{"model": DIR, "rank": 0, "size": 1}'

loads its shard, prints its exchange address (a JSON line), serves until its stdin closes, then prints its
statistics (a JSON line) and exits. A deployment's expert workers (`kvbaton serve --expert-workers`, the role in
`worker/roles/expert.py`) run the same shard and server under the router. JOB keys: model, rank, size, and
optionally dtype (float32 | bfloat16), host (127.0.0.1), threads (1), redundant (0: the pool's redundant slots),
encrypt (false: CURVE on its exchange socket, keys from the secret)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from kvbaton.parallel.afd.server import ExpertServer
from kvbaton.parallel.afd.shard import ExpertShard, ShardSpec
from kvbaton.wire import SECRET_ENV


def main() -> None:
    secret = os.environ.get(SECRET_ENV)
    if not secret:  # NOTE: not a fresh one: the attention workers must sign with the same
        sys.exit(f"kvbaton expert worker: set {SECRET_ENV} (the attention workers' too)")
    job = json.loads(sys.argv[1])
    torch.set_num_threads(job.get("threads", 1))
    shard = ExpertShard(ShardSpec(Path(job["model"]), job["rank"], job["size"],
                                  {"float32": torch.float32, "bfloat16": torch.bfloat16}[job.get("dtype", "float32")],
                                  redundant=job.get("redundant", 0)))
    server = ExpertServer(shard, secret.encode(), host=job.get("host", "127.0.0.1"), encrypt=job.get("encrypt", False))
    server.start()
    print(json.dumps({"address": server.address}), flush=True)
    sys.stdin.read()  # until the caller closes it
    server.close()
    s = server.stats
    print(json.dumps({"exchanges": s.exchanges, "rows": s.rows, "refused_frames": s.refused_frames,
                      "busy_s": s.busy_s, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                      "alive_s": time.monotonic() - server.started}), flush=True)


if __name__ == "__main__":
    main()
