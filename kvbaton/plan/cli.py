"""`kvbaton plan`: size a deployment for a load (search), or say why a running one misses its SLO (diagnose).

    kvbaton plan --model llama-3-8b --hardware h100-sxm --qps 100 --input-len 1024 --output-len 256
    kvbaton plan --model llama-3-70b --hardware h800-sxm --weight-dtype fp16 --nodes 8 --current-tp 4 \\
        --current-pp 2 --qps 200 --input-len 1500 --output-len 300 --slo-tpot-ms 120   # diagnose
    kvbaton plan --example article      # the article's case: the same as the line above, with its observations
    kvbaton plan --afd-profile benchmarks/results/afd-<stamp>.json --afd-workers 4 --afd-batch 32   # AFD split

An example fixes the model, hardware, deployment and load; the simulation flags (--window-s, --seed, ...) and
the outputs (--json, --plot-dir) still apply.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console

from kvbaton.config import ConfigError, SchedulerConfig
from kvbaton.plan import afd
from kvbaton.plan.deployment import DeploymentPlan
from kvbaton.plan.diagnose import Observation
from kvbaton.plan.evaluate import SimOptions
from kvbaton.plan.examples import EXAMPLES, Scenario
from kvbaton.plan.run import run_scenario
from kvbaton.plan.workload import Workload
from kvbaton.sim.hardware import HARDWARE_PRESETS, hardware_preset
from kvbaton.sim.links import LINK_PRESETS
from kvbaton.sim.model_spec import MODEL_PRESETS, KVDtype, parse_dtype, parse_kv_dtype
from kvbaton.sim.roofline import Parallelism


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="capacity planning: KV memory, TP/PP, P:D ratio, GPU count (simulated)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--example", choices=list(EXAMPLES), help="a worked case (see kvbaton/plan/examples.py)")
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", default="smollm2-135m", help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json")
    m.add_argument("--hardware", default="xeon-amx-2vcpu", help=f"one of {', '.join(HARDWARE_PRESETS)}")
    m.add_argument("--weight-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8, int4")
    m.add_argument("--kv-dtype", default="auto", help="auto (the weights' 16-bit type), fp16, bf16, fp8 (1 byte, "
                                                      "per-tensor scale), fp8_e4m3 / int8 (kvbaton's: + a scale "
                                                      "per token and head)")
    m.add_argument("--nodes", type=int, default=None, help="GPUs available = nodes x the hardware's devices per node")
    m.add_argument("--gpus", type=int, default=None, help="GPUs available (instead of --nodes)")
    m.add_argument("--kv-link", default="roce200", choices=list(LINK_PRESETS), help="between nodes: PD's KV moves")
    w = p.add_argument_group("load and SLOs")
    w.add_argument("--qps", type=float, default=None, help="requests per second, the whole deployment")
    w.add_argument("--input-len", type=int, default=1024)
    w.add_argument("--output-len", type=int, default=256)
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    w.add_argument("--prefix-len", type=int, default=0, help="a shared prefix of this many tokens before each prompt")
    w.add_argument("--num-prefixes", type=int, default=4)
    w.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    w.add_argument("--slo-tpot-ms", type=float, default=100.0)
    w.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")
    d = p.add_argument_group("deployment")
    d.add_argument("--tp", default="1,2,4,8", help="TP sizes to search")
    d.add_argument("--pp", default="1,2", help="PP sizes to search")
    d.add_argument("--no-pd", action="store_true", help="search colocated instances only")
    d.add_argument("--no-ep", action="store_true", help="MoE: do not try EP = TP with data-parallel attention")
    d.add_argument("--current-tp", type=int, default=None, help="diagnose this running deployment (with --current-pp)")
    d.add_argument("--current-pp", type=int, default=1)
    d.add_argument("--observed-tpot-p99-ms", type=float, default=None)
    d.add_argument("--observed-memory", type=float, default=None, help="fraction of GPU memory in use, e.g. 0.95")
    d.add_argument("--observed-sm-active", type=float, default=None, help="e.g. 0.22")
    d.add_argument("--max-num-seqs", type=int, default=256)
    d.add_argument("--max-num-batched-tokens", type=int, default=8192)
    d.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    d.add_argument("--block-size", type=int, default=16)
    a = p.add_argument_group("attention/FFN disaggregation (instead of a search: kvbaton/plan/afd.py)")
    a.add_argument("--afd-profile", default=None, metavar="FILE",
                   help="each side's costs (JSON; benchmarks/bench_afd.py's result holds one fitted on its machine)")
    a.add_argument("--afd-workers", type=int, default=2, help="workers to split into attention and expert workers")
    a.add_argument("--afd-batch", type=int, default=32, help="sequences each attention worker decodes")
    a.add_argument("--afd-micro-batches", default="1,2,3,4", help="micro-batch counts to consider")
    s = p.add_argument_group("simulation and output")
    s.add_argument("--window-s", type=float, default=60.0, help="simulated seconds of arrivals per run")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--search-steps", type=int, default=5, help="simulations per goodput search")
    s.add_argument("--max-requests", type=int, default=1500, help="per simulated run")
    s.add_argument("--json", default=None, help="write the result here")
    s.add_argument("--plot-dir", default=None, help="write PNG plots here")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(args: argparse.Namespace) -> int:
    if args.afd_profile:
        return plan_afd(args)
    scenario = EXAMPLES[args.example] if args.example else scenario_from_args(args)
    options = SimOptions(window_s=_positive(args.window_s, "--window-s"), seed=args.seed,
                         search_steps=int(_positive(args.search_steps, "--search-steps")),
                         max_requests=int(_positive(args.max_requests, "--max-requests")))
    console = Console() if Console().is_terminal else Console(width=160)
    progress = Console(stderr=True)
    note = (lambda _: None) if args.quiet else (lambda line: progress.print(f"[dim]{line}[/dim]"))
    return run_scenario(scenario, options, console, note, json_path=args.json, plot_dir=args.plot_dir)


def plan_afd(args: argparse.Namespace) -> int:
    report = afd.plan(afd.load_profile(args.afd_profile), args.afd_workers, args.afd_batch,
                      _sizes(args.afd_micro_batches, "--afd-micro-batches"))
    afd.print_report(Console() if Console().is_terminal else Console(width=160), report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    return 0


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    if args.qps is None:
        raise ConfigError("say what load to plan for: --qps (or --example article)")
    weight_dtype = parse_dtype(args.weight_dtype)
    kv_dtype = (KVDtype.FP16 if weight_dtype.value == "fp16" else KVDtype.BF16) if args.kv_dtype == "auto" \
        else parse_kv_dtype(args.kv_dtype)
    load = Workload(qps=args.qps, input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                    prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, slo_ttft_ms=args.slo_ttft_ms,
                    slo_tpot_ms=args.slo_tpot_ms, attainment_target=args.attainment)
    current = Parallelism(args.current_tp, args.current_pp) if args.current_tp else Parallelism()
    deployment = DeploymentPlan(parallel=current, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                      max_num_batched_tokens=args.max_num_batched_tokens),
                            gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size)
    observation = None
    if args.current_tp:
        observation = Observation(tpot_p99_ms=args.observed_tpot_p99_ms, memory_used=args.observed_memory,
                                  sm_active=args.observed_sm_active)
    hardware = hardware_preset(args.hardware)
    devices = _devices(args, hardware.devices_per_node)
    if observation is not None and devices is None:
        raise ConfigError("diagnosing a running deployment needs its size: --nodes or --gpus")
    return Scenario(name="cli", title=f"{args.model} on {args.hardware}", model=args.model, hardware=args.hardware,
                    devices=devices, deployment=deployment, workload=load, kv_link=args.kv_link,
                    observation=observation, tps=_sizes(args.tp, "--tp"), pps=_sizes(args.pp, "--pp"),
                    search_pd=not args.no_pd, try_ep=not args.no_ep)


def _devices(args: argparse.Namespace, per_node: int) -> int | None:
    if args.gpus is not None and args.nodes is not None:
        raise ConfigError("give --nodes or --gpus, not both")
    if args.gpus is not None:
        return int(_positive(args.gpus, "--gpus"))
    return None if args.nodes is None else int(_positive(args.nodes, "--nodes")) * per_node


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated sizes, e.g. 1,2,4,8; not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"{flag}: sizes must be at least 1")
    return sizes


def _positive(value: float, flag: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be positive, not {value}")
    return value
