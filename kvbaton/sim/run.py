"""One `kvbaton sim run`: build the deployment and the load from the flags, simulate each rate, report.

The report is the bench's own (TTFT/TPOT/ITL/E2E percentiles, goodput, SLO attainment), plus
what only a simulator can show: each instance's busy time, batch sizes, KV usage, preemptions.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvbaton.config import ConfigError, SchedulerConfig
from kvbaton.sim.calibrate import calibrate
from kvbaton.sim.host import HostOverhead
from kvbaton.sim.latency import StepLatencyModel
from kvbaton.sim.links import LinkModel, link_preset
from kvbaton.sim.simulator import SimRun, simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec, SimRequest
from kvbaton.sim.workload import synthetic_requests, trace_medians, trace_requests, trace_ttfts
from kvbaton.workload.arrivals import ArrivalConfig
from kvbaton.workload.flags import dataset_config, fresh_seed, parse_rates
from kvbaton.workload.metrics import SLO, Summary, summarize
from kvbaton.workload.records import RunResult
from kvbaton.workload.report import print_report, rate_label, result_document, write_result_json


def run_simulation(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None:
        raise ConfigError("--max-concurrency (a closed loop) is not simulated; give open-loop rates")
    cluster = cluster_from_args(args)
    seed = args.seed if args.seed is not None else fresh_seed()
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    console = Console() if Console().is_terminal else Console(width=140)
    loads = _loads(args, seed)
    host = "" if cluster.host.is_zero else f", served as calibrated ({cluster.host.describe()})"
    console.print(f"kvbaton sim: seed {seed}, {cluster.label}, latency {cluster.decode.latency.name}{host}, "
                  f"{len(loads[0][1])} requests, rates {', '.join(rate_label(r) for r, _ in loads)}")
    runs = [simulate(cluster, requests, request_rate=rate, max_duration_s=args.max_duration_s, seed=seed)
            for rate, requests in loads]
    summaries = [summarize(run.result, slo) for run in runs]
    print_report(summaries, slo, console)
    for run in runs:
        print_instances(run, console)
    _write_outputs(args, cluster, seed, [r.result for r in runs], summaries, slo, console)
    return 0


def _loads(args: argparse.Namespace, seed: int) -> list[tuple[float, list[SimRequest]]]:
    if args.trace is not None:
        requests, rate = trace_requests(args.trace, seed=seed)
        return [(rate, requests)]
    dataset = dataset_config(args)
    return [(rate, synthetic_requests(dataset, ArrivalConfig(rate, args.arrival, args.burstiness), seed))
            for rate in parse_rates(args)]


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    instance = instance_from_args(args)
    host = HostOverhead.load(args.host_overhead) if getattr(args, "host_overhead", None) else HostOverhead()
    return ClusterSpec(decode=instance, num_decode=args.decode, num_prefill=args.prefill, link=_link(args),
                       prefill_policy=args.routing, decode_policy=args.routing,
                       local_prefill_threshold=args.local_prefill_threshold,
                       max_waiting_requests=args.max_waiting_requests, host=host)


def run_calibration(args: argparse.Namespace) -> int:
    """`kvbaton sim calibrate`: the served steps of `--step-trace` against `--profile`, and the dispatch delays of
    `--trace`'s requests beyond their replay with those steps."""
    from kvbaton.sim.profiled import ProfiledLatency
    from kvbaton.sim.served_steps import read_workers, served_steps

    if args.profile is None:
        raise ConfigError("calibration compares served steps with the profile of their engine: give --profile")
    cluster = cluster_from_args(args)
    requests, rate = trace_requests(args.trace)
    _, tpot_ms = trace_medians(args.trace)
    profile = json.loads(Path(args.profile).read_text())
    roles = served_steps(read_workers(args.step_trace), ProfiledLatency.load(args.profile), profile)

    def replay(host: HostOverhead) -> RunResult:
        return simulate(replace(cluster, host=host), requests, request_rate=rate).result

    fit = calibrate(replay, roles=roles, measured_ttft_s=trace_ttfts(args.trace), measured_tpot_p50_ms=tpot_ms,
                    label=f"{Path(args.trace).name} ({cluster.label})")
    fit.host.save(Path(args.out))
    print(f"kvbaton sim calibrate: {cluster.label}, {len(requests)} requests of {args.trace}")
    for role, steps in fit.host.roles.items():
        print(f"  {role:<7} {steps.num_steps} served steps: {steps.describe()}")
    print(f"  measured     TTFT p50 {fit.measured_ttft_p50_ms:8.1f} ms   TPOT p50 {tpot_ms:7.1f} ms")
    print(f"  engines only TTFT p50 {fit.engines_ttft_p50_ms:8.1f} ms   TPOT p50 {fit.engines_tpot_p50_ms:7.1f} ms")
    print(f"  calibrated   TTFT p50 {fit.simulated_ttft_p50_ms:8.1f} ms   TPOT p50 {fit.simulated_tpot_p50_ms:7.1f} ms"
          f"   ({fit.host.describe().split(';')[0]})")
    print(f"host overhead: {args.out}")
    return 0


def _link(args: argparse.Namespace) -> LinkModel:
    if args.link_gbps is None and args.link_latency_us is None:
        return link_preset(args.link)
    base = link_preset(args.link)
    return LinkModel("custom", args.link_gbps or base.bandwidth_gbps,
                     base.latency_us if args.link_latency_us is None else args.link_latency_us)


def instance_from_args(args: argparse.Namespace) -> InstanceSpec:
    latency, defaults = _latency(args)
    num_blocks = args.num_blocks or defaults.get("num_blocks")
    if not num_blocks:
        raise ConfigError("say how large each instance's KV pool is: --num-blocks")
    kv_bytes = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else defaults.get("kv_bytes_per_token")
    if kv_bytes is None and args.prefill:
        raise ConfigError("a disaggregated deployment moves KV: give --kv-bytes-per-token")
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                enable_chunked_prefill=not args.no_chunked_prefill,
                                long_prefill_token_threshold=args.long_prefill_token_threshold)
    return InstanceSpec(latency=latency, num_blocks=int(num_blocks), block_size=args.block_size, scheduler=scheduler,
                        max_model_len=args.max_model_len or int(defaults.get("max_model_len", 8192)),
                        enable_prefix_caching=not args.no_prefix_caching, kv_bytes_per_token=int(kv_bytes or 0))


def _latency(args: argparse.Namespace) -> tuple[StepLatencyModel, dict]:
    """The step-latency model the flags name, and the instance figures it knows (pool size, KV bytes)."""
    if (args.profile is None) == (args.hardware is None):
        raise ConfigError("choose one step-latency model: --profile JSON (measured) or --hardware (roofline)")
    if args.profile is not None:
        from kvbaton.sim.profiled import ProfiledLatency

        latency = ProfiledLatency.load(args.profile)  # a clear error for a file that is not a profile
        profile = json.loads(Path(args.profile).read_text())  # the profiled engine's pool, as defaults
        return latency, {k: profile[k] for k in ("num_blocks", "kv_bytes_per_token", "max_model_len") if k in profile}
    return _roofline(args)


def _roofline(args: argparse.Namespace) -> tuple[StepLatencyModel, dict]:
    """A roofline of `--tp` x `--pp` devices of `--hardware` running `--model-preset` (bf16 weights and KV)."""
    from kvbaton.sim.hardware import hardware_preset
    from kvbaton.sim.model_spec import KVDtype, resolve_model
    from kvbaton.sim.roofline import Parallelism, RooflineLatency

    if args.model_preset is None:
        raise ConfigError("--hardware needs --model-preset (a preset name or an HF config.json)")
    if args.num_blocks is None:
        raise ConfigError("--hardware needs --num-blocks (`kvbaton plan` prints an instance's KV pool)")
    model = resolve_model(args.model_preset)
    latency = RooflineLatency(model=model, hardware=hardware_preset(args.hardware),
                              parallel=Parallelism(tp=args.tp, pp=args.pp))
    return latency, {"kv_bytes_per_token": model.kv_bytes_per_token(KVDtype.BF16)}


def print_instances(run: SimRun, console: Console) -> None:
    table = Table(title=f"instances at {rate_label(run.result.request_rate)} req/s "
                        f"(simulated {run.result.duration_s:.1f} s in {run.wall_s:.2f} s)")
    for col in ("instance", "steps", "busy", "tokens/step", "decode batch", "KV mean", "KV peak", "preempted"):
        table.add_column(col, justify="left" if col == "instance" else "right")
    duration = max(run.result.duration_s, 1e-9)
    for s in run.instances:
        table.add_row(s.name, str(s.num_steps), f"{s.busy_s / duration:.0%}", f"{s.mean_batch_tokens:.1f}",
                      f"{s.mean_decode_batch:.1f}", f"{s.mean_kv_usage:.0%}", f"{s.peak_kv_usage:.0%}",
                      str(s.num_preemptions))
    console.print(table)
    console.print("routing: " + ", ".join(f"{k} {v}" for k, v in run.counters.items()))


def _write_outputs(args: argparse.Namespace, cluster: ClusterSpec, seed: int, results: list[RunResult],
                   summaries: list[Summary], slo: SLO, console: Console) -> None:
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
        config = {**config, "seed": seed, "deployment": cluster.label, "simulated": True,
                  "latency_model": cluster.decode.latency.name, "host_overhead": cluster.host.describe()}
        write_result_json(args.result_json, result_document(config, results, summaries))
        console.print(f"results: {args.result_json}")
    if args.plot_dir:
        from kvbaton.workload.plots import write_plots

        for path in write_plots(args.plot_dir, results, summaries, slo):
            console.print(f"plot: {path}")

