"""Shared by the simulator's benchmarks: the engine's pool as `kvbaton serve` sizes it, this machine's step
profiles and frontend costs, one measured `kvbaton bench serve` run, and its replay through the simulator."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from common.machine import cpu_kind
from common.servers import Server, free_port, kvbaton_server
from kvbaton.bench.metrics import SLO, Summary, summarize
from kvbaton.config import SchedulerConfig
from kvbaton.sim.calibrate import calibrate
from kvbaton.sim.host import HostOverhead
from kvbaton.sim.links import link_preset
from kvbaton.sim.profiled import ProfiledLatency
from kvbaton.sim.simulator import SimRun, simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec
from kvbaton.sim.workload import trace_medians, trace_requests

MAX_MODEL_LEN = 4096
KV_GB = 2.0
COMMON_SERVE_ARGS = ["--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb", str(KV_GB)]
HOST_CORES = len(os.sched_getaffinity(0))  # what the workers and the frontend share
RANDOM = ["--dataset", "random", "--input-len", "256", "--output-len", "64", "--range-ratio", "0.5"]


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
    """`sim-profile-<cpu kind>-t{threads}.json` from `reuse` if it is there, else measured now into `out_dir`."""
    name = f"sim-profile-{cpu_kind()}-t{threads}.json"
    if reuse is not None and (reuse / name).exists():
        return reuse / name
    path = out_dir / name
    print(f"== profiling the engine, {threads} thread(s) -> {path}", flush=True)
    subprocess.run([sys.executable, "-m", "kvbaton.cli", "sim", "profile", "--model", model_dir, "--dtype",
                    "bfloat16", "--threads", str(threads), "--out", str(path)], check=True)
    return path


def measure(deployment: Deployment, bench_args: list[str], *, n: int, seed: int, out: Path, model_dir: str) -> Path:
    """One `kvbaton bench serve` run (`n` requests, --ignore-eos, 2 warm-ups) against a fresh `kvbaton serve` of
    `deployment`; its result JSON (the trace to replay) is `out`, the server's log beside it."""
    spec = kvbaton_server(name=f"kvbaton serve ({out.stem})", port=free_port(),
                          serve_args=[*COMMON_SERVE_ARGS, *deployment.serve_args()], env=dict(os.environ),
                          timeout_s=300, log_path=out.with_suffix(".log"), health_path="/health")
    with Server(spec) as server:
        subprocess.run([sys.executable, "-m", "kvbaton.cli", "bench", "serve", "--base-url", server.base_url,
                        *bench_args, "--num-prompts", str(n), "--ignore-eos", "--seed", str(seed),
                        "--tokenizer", model_dir, "--num-warmups", "2", "--result-json", str(out), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


# The calibration loads: not among any benchmark's measured loads, so what is validated was not fitted. Two
# workers of 1 thread share the cores with the frontend as 1P+1D and two replicas do.
CALIBRATION = {2: (Deployment(threads=2), [*RANDOM, "--request-rate", "1"]),
               1: (Deployment(threads=1, num_decode=2), [*RANDOM, "--request-rate", "1"])}


def ensure_host_overhead(threads: int, out_dir: Path, model_dir: str, reuse: Path | None, *, profile: Path,
                         seed: int, n: int = 40) -> HostOverhead:
    """`sim-host-<cpu kind>-t{threads}.json` from `reuse` if it is there, else fitted now to the calibration
    load: its trace from `reuse` if that is there, else measured now."""
    name = f"sim-host-{cpu_kind()}-t{threads}"
    if reuse is not None and (reuse / f"{name}.json").exists():
        return HostOverhead.load(reuse / f"{name}.json")
    deployment, bench_args = CALIBRATION[threads]
    trace = out_dir / f"{name}-trace.json"
    if reuse is not None and (reuse / trace.name).exists():  # measured before: fitted again (a new step model)
        trace = reuse / trace.name
        print(f"== calibrating the frontend's costs, {threads}-thread workers, on {trace}", flush=True)
    else:
        print(f"== calibrating the frontend's costs, {threads}-thread workers: {' '.join(bench_args)}", flush=True)
        measure(deployment, bench_args, n=n, seed=seed, out=trace, model_dir=model_dir)
    ttft_ms, tpot_ms = trace_medians(trace)
    pool = kv_pool(model_dir, KV_GB)
    fit = calibrate(lambda host: replay(deployment, trace, profile, pool, SLO(), host)[0],
                    measured_ttft_p50_ms=ttft_ms, measured_tpot_p50_ms=tpot_ms, host_cores=HOST_CORES,
                    label=f"{trace.name}: {' '.join(deployment.serve_args())}, {' '.join(bench_args)}")
    fit.host.save(out_dir / f"{name}.json")
    print(f"   {fit.host.describe()} (TTFT p50 {ttft_ms:.1f} ms, TPOT p50 {tpot_ms:.1f} ms measured; engines alone "
          f"{fit.uncalibrated_ttft_p50_ms:.1f} / {fit.uncalibrated_tpot_p50_ms:.1f})", flush=True)
    return fit.host


def replay(deployment: Deployment, trace: Path, profile: Path, pool: tuple[int, int], slo: SLO,
           host: HostOverhead | None = None) -> tuple[Summary, SimRun]:
    """The measured run `trace` (send times, lengths) through the simulated `deployment` (and frontend)."""
    num_blocks, kv_bytes = pool
    instance = InstanceSpec(latency=ProfiledLatency.load(profile), num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN,
                            kv_bytes_per_token=kv_bytes, cpu_threads=deployment.threads,
                            scheduler=SchedulerConfig(max_num_batched_tokens=deployment.max_num_batched_tokens))
    cluster = ClusterSpec(decode=instance, num_decode=deployment.num_decode, num_prefill=deployment.num_prefill,
                          link=link_preset(deployment.link), local_prefill_threshold=deployment.local_prefill_threshold)
    requests, rate = trace_requests(trace)
    run = simulate(replace(cluster, host=host or HostOverhead()), requests, request_rate=rate)
    return summarize(run.result, slo), run
