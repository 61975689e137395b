"""One expert worker of an AFD expert pool, as its own process: `python afd_expert.py JOB_JSON` loads its shard,
prints its exchange address (a JSON line), and serves until its stdin closes (the test's end), then prints its
statistics (a JSON line) and exits. The role's own process (`kvbaton serve --expert-workers`) runs the same
shard and server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvbaton.parallel.afd.server import ExpertServer
from kvbaton.parallel.afd.shard import ExpertShard, ShardSpec
from kvbaton.wire import cluster_secret


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    shard = ExpertShard(ShardSpec(Path(job["model"]), job["rank"], job["size"],
                                  {"float32": torch.float32, "bfloat16": torch.bfloat16}[job.get("dtype", "float32")]))
    server = ExpertServer(shard, cluster_secret())
    server.start()
    print(json.dumps({"address": server.address}), flush=True)
    sys.stdin.read()  # until the test closes it
    server.close()
    s = server.stats
    print(json.dumps({"exchanges": s.exchanges, "rows": s.rows, "refused_frames": s.refused_frames}), flush=True)


if __name__ == "__main__":
    main()
