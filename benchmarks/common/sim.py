"""Shared by the simulator's benchmarks: the engine's pool as `kvbaton serve` sizes it, this machine's step
profiles, each deployment's calibration (what serving adds: `kvbaton sim calibrate` on a load of its own), one
measured `kvbaton bench serve` run, and its replay through the simulator."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from common.machine import cpu_kind
from common.report import read_json
from common.servers import Server, free_port, kvbaton_server
from kvbaton.config import SchedulerConfig
from kvbaton.sim.calibrate import calibrate
from kvbaton.sim.host import HostOverhead
from kvbaton.sim.links import link_preset
from kvbaton.sim.profiled import ProfiledLatency
from kvbaton.sim.served_steps import read_workers, served_steps
from kvbaton.sim.simulator import simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec
from kvbaton.sim.workload import trace_medians, trace_requests, trace_ttfts
from kvbaton.workload.metrics import SLO, Summary, summarize
from kvbaton.workload.records import RunResult

MAX_MODEL_LEN = 4096
KV_GB = 2.0
COMMON_SERVE_ARGS = ["--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb", str(KV_GB)]
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

    @property
    def label(self) -> str:
        """A name for its calibration files."""
        shape = f"{self.num_prefill}p{self.num_decode}d-l{self.local_prefill_threshold}" if self.num_prefill else \
            "colocated" if self.num_decode == 1 else f"{self.num_decode}replicas"
        return f"{shape}-t{self.threads}-b{self.max_num_batched_tokens}"

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


def measure(deployment: Deployment, bench_args: list[str], *, n: int, seed: int, out: Path, model_dir: str,
            step_trace: Path | None = None) -> Path:
    """One `kvbaton bench serve` run (`n` requests, --ignore-eos, 2 warm-ups) against a fresh `kvbaton serve` of
    `deployment` (its workers' steps traced into `step_trace`, if given); its result JSON (the trace to replay)
    is `out`, the server's log beside it."""
    traced = ["--step-trace", str(step_trace)] if step_trace is not None else []
    spec = kvbaton_server(name=f"kvbaton serve ({out.stem})", port=free_port(),
                          serve_args=[*COMMON_SERVE_ARGS, *deployment.serve_args(), *traced], env=dict(os.environ),
                          timeout_s=300, log_path=out.with_suffix(".log"), health_path="/health")
    with Server(spec) as server:
        subprocess.run([sys.executable, "-m", "kvbaton.cli", "bench", "serve", "--base-url", server.base_url,
                        *bench_args, "--num-prompts", str(n), "--ignore-eos", "--seed", str(seed),
                        "--tokenizer", model_dir, "--num-warmups", "2", "--result-json", str(out), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


# Every deployment is calibrated on this load, which is none of any benchmark's measured loads: what is validated
# was not fitted. Its prompts span every prompt bucket the simulator prices apart (kvbaton.sim.host.PROMPT_BUCKETS):
# short ones of 32-96 tokens, 30% long ones of 320-960, and the chunks of those.
CALIBRATION_LOAD = ["--dataset", "mixed", "--short-input-len", "64", "--long-input-len", "640", "--long-fraction",
                    "0.3", "--range-ratio", "0.5", "--output-len", "64", "--request-rate", "0.7"]
CALIBRATION_PROMPTS = 60
CALIBRATION_TEXT = ("70% prompts of 32-96 tokens and 30% of 320-960, 32-96 out, 0.7 req/s, "
                    f"{CALIBRATION_PROMPTS} requests")


def ensure_host_overhead(deployment: Deployment, out_dir: Path, model_dir: str, reuse: Path | None, *,
                         profile: Path, seed: int) -> HostOverhead:
    """`sim-host-<cpu kind>-<deployment>.json` from `reuse` if it is there, else calibrated now on the calibration
    load: its measured run and step traces from `reuse` if they are there (a new step profile), else measured now."""
    name = f"sim-host-{cpu_kind()}-{deployment.label}"
    if reuse is not None and (reuse / f"{name}.json").exists():
        return HostOverhead.load(reuse / f"{name}.json")
    trace, steps = out_dir / f"{name}-trace.json", out_dir / f"{name}-steps"
    if reuse is not None and (reuse / trace.name).exists() and (reuse / steps.name).is_dir():
        trace, steps = reuse / trace.name, reuse / steps.name
        print(f"== calibrating {deployment.label} on {trace}", flush=True)
    else:
        print(f"== calibrating {deployment.label}: {' '.join(CALIBRATION_LOAD)}", flush=True)
        for old in steps.glob("steps-*.jsonl"):  # one run's workers only
            old.unlink()
        measure(deployment, CALIBRATION_LOAD, n=CALIBRATION_PROMPTS, seed=seed, out=trace, model_dir=model_dir,
                step_trace=steps)
    ttft_ms, tpot_ms = trace_medians(trace)
    pool = kv_pool(model_dir, KV_GB)
    roles = served_steps(read_workers([steps]), ProfiledLatency.load(profile), read_json(profile))
    fit = calibrate(lambda host: replay_runs(deployment, trace, profile, pool, host)[0], roles=roles,
                    measured_ttft_s=trace_ttfts(trace), measured_tpot_p50_ms=tpot_ms,
                    label=f"{trace.name}: {' '.join(deployment.serve_args())}, {' '.join(CALIBRATION_LOAD)}")
    fit.host.save(out_dir / f"{name}.json")
    print(f"   {fit.host.describe()} (TTFT p50 {ttft_ms:.1f} ms, TPOT p50 {tpot_ms:.1f} ms measured; engines alone "
          f"{fit.engines_ttft_p50_ms:.1f} / {fit.engines_tpot_p50_ms:.1f}; calibrated {fit.simulated_ttft_p50_ms:.1f}"
          f" / {fit.simulated_tpot_p50_ms:.1f})", flush=True)
    return fit.host



def require_traces(traces: list[Path]) -> None:
    """Stop with a clear message when a replayed run's measured traces are not beside its JSON: benchmarks/results
    keeps a run's summary, not the traces it was measured on."""
    missing = [str(trace) for trace in traces if not trace.exists()]
    if missing:
        raise SystemExit(f"--replay: {len(missing)} measured trace(s) missing beside the run's JSON, e.g. "
                         f"{missing[0]} (benchmarks/results keeps runs' summaries, not their traces): replay a run "
                         "whose traces you kept, or measure again without --replay")

SEEDS = 5  # replays per measured run, pooled: the simulator's own spread of served steps averages out


def replay(deployment: Deployment, trace: Path, profile: Path, pool: tuple[int, int], slo: SLO,
           host: HostOverhead | None = None, seeds: int = SEEDS) -> tuple[Summary, float]:
    """The measured run `trace` (send times, lengths) through the simulated `deployment` (and what serving adds),
    `seeds` times with different draws of served steps and delays, every request of every replay summarized
    together; returns the summary and the wall seconds of one replay."""
    pooled, wall_s = replay_runs(deployment, trace, profile, pool, host or HostOverhead(), seeds)
    return summarize(pooled, slo), wall_s


def replay_runs(deployment: Deployment, trace: Path, profile: Path, pool: tuple[int, int], host: HostOverhead,
                seeds: int = SEEDS) -> tuple[RunResult, float]:
    """`replay`'s runs, their records pooled (one replay's request ids repeat in the next)."""
    num_blocks, kv_bytes = pool
    instance = InstanceSpec(latency=ProfiledLatency.load(profile), num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN,
                            kv_bytes_per_token=kv_bytes,
                            scheduler=SchedulerConfig(max_num_batched_tokens=deployment.max_num_batched_tokens))
    cluster = ClusterSpec(decode=instance, num_decode=deployment.num_decode, num_prefill=deployment.num_prefill,
                          link=link_preset(deployment.link), local_prefill_threshold=deployment.local_prefill_threshold,
                          host=host)
    requests, rate = trace_requests(trace)
    runs = [simulate(cluster, requests, request_rate=rate, seed=seed) for seed in range(seeds)]
    pooled = RunResult(rate, None, fmean(r.result.duration_s for r in runs), sum(r.result.num_planned for r in runs),
                       tuple(rec for r in runs for rec in r.result.records))
    return pooled, fmean(r.wall_s for r in runs)
