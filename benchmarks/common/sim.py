"""Shared by the simulator's benchmarks: the engine's pool as `kvbaton serve` sizes it, this machine's step
profiles, and the replay of a measured `kvbaton bench serve` run through the simulator."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbaton.bench.metrics import SLO, Summary, summarize
from kvbaton.config import SchedulerConfig
from kvbaton.sim.links import link_preset
from kvbaton.sim.profiled import ProfiledLatency
from kvbaton.sim.simulator import SimRun, simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec
from kvbaton.sim.workload import trace_requests

MAX_MODEL_LEN = 4096


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What a `kvbaton serve` set-up is to the simulator."""

    threads: int  # per worker: picks the profile
    num_prefill: int = 0
    num_decode: int = 1
    max_num_batched_tokens: int = 2048
    local_prefill_threshold: int = 64
    link: str = "host-shm"

    def serve_args(self) -> list[str]:
        """The `kvbaton serve` flags of this set-up (the link: kvbaton's shm transport)."""
        args = ["--threads", str(self.threads), "--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.num_prefill:
            args += ["--prefill", str(self.num_prefill), "--decode", str(self.num_decode), "--kv-transport", "shm",
                     "--local-prefill-threshold", str(self.local_prefill_threshold)]
        elif self.num_decode > 1:
            args += ["--decode", str(self.num_decode)]
        return args


def kv_pool(model_dir: str, kv_gb: float) -> tuple[int, int]:
    """(blocks, KV bytes per token) of a bf16 worker with `--kv-cache-memory-gb kv_gb`, as the engine sizes it."""
    import torch

    from kvbaton.config import ModelConfig
    from kvbaton.engine.core import model_kv_layout

    layout = model_kv_layout(ModelConfig.from_dir(Path(model_dir)), 16, torch.bfloat16)
    return int(kv_gb * 2**30 // layout.bytes_per_block), layout.bytes_per_block // 16


def ensure_profile(threads: int, out_dir: Path, model_dir: str, reuse: Path | None) -> Path:
    """`sim-profile-t{threads}.json` from `reuse` if it is there, else measured now into `out_dir`."""
    if reuse is not None and (reuse / f"sim-profile-t{threads}.json").exists():
        return reuse / f"sim-profile-t{threads}.json"
    path = out_dir / f"sim-profile-t{threads}.json"
    print(f"== profiling the engine, {threads} thread(s) -> {path}", flush=True)
    subprocess.run([sys.executable, "-m", "kvbaton.cli", "sim", "profile", "--model", model_dir, "--dtype",
                    "bfloat16", "--threads", str(threads), "--out", str(path)], check=True)
    return path


def replay(deployment: Deployment, trace: Path, profile: Path, pool: tuple[int, int], slo: SLO) -> tuple[Summary,
                                                                                                        SimRun]:
    """The measured run `trace` (send times, lengths) through the simulated `deployment`."""
    num_blocks, kv_bytes = pool
    instance = InstanceSpec(latency=ProfiledLatency.load(profile), num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN,
                            kv_bytes_per_token=kv_bytes,
                            scheduler=SchedulerConfig(max_num_batched_tokens=deployment.max_num_batched_tokens))
    cluster = ClusterSpec(decode=instance, num_decode=deployment.num_decode, num_prefill=deployment.num_prefill,
                          link=link_preset(deployment.link), local_prefill_threshold=deployment.local_prefill_threshold)
    requests, rate = trace_requests(trace)
    run = simulate(cluster, requests, request_rate=rate)
    return summarize(run.result, slo), run
