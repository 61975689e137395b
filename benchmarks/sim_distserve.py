"""DistServe's result, in the simulator: goodput per GPU of disaggregated vs colocated serving as the TPOT SLO
tightens.

    .venv/bin/python benchmarks/sim_distserve.py            # Llama-3-8B on H100 roofline (~2 min on 2 cores)
    .venv/bin/python benchmarks/sim_distserve.py --tpot-slos-ms 80,40 --num-prompts 200

For each TPOT SLO (TTFT SLO fixed), the highest request rate at which >= 90% of requests meet both SLOs is
found by bisection (DistServe's attainment goodput), for a colocated instance (1 GPU) and for P:D units of
1P+1D, 2P+1D and 1P+2D (one GPU each); per-GPU goodput = that rate / GPUs, and the best P:D unit is
compared against colocated. Every instance runs the real scheduler (chunked prefill, 2048-token budget) over
the H100 roofline (`kvbaton/sim/roofline.py`); KV moves over NVLink. Only a model: the factor is what the
simulator predicts from its roofline, not a measurement.

Writes benchmarks/results/sim-distserve.md and sim-distserve.png.
"""

from __future__ import annotations

import argparse
import sys
import time

from common.report import RESULTS_DIR, command_line
from kvbaton.config import SchedulerConfig
from kvbaton.sim.hardware import hardware_preset
from kvbaton.sim.links import link_preset
from kvbaton.sim.model_spec import KVDtype, resolve_model
from kvbaton.sim.roofline import RooflineLatency
from kvbaton.sim.simulator import simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec
from kvbaton.sim.workload import synthetic_requests
from kvbaton.workload.arrivals import ArrivalConfig
from kvbaton.workload.datasets import DatasetConfig
from kvbaton.workload.metrics import SLO, summarize

UNITS = {"colocated": (0, 1), "1P+1D": (1, 1), "2P+1D": (2, 1), "1P+2D": (1, 2)}
ATTAINMENT = 0.9


def cluster(name: str, instance: InstanceSpec) -> ClusterSpec:
    num_prefill, num_decode = UNITS[name]
    return ClusterSpec(decode=instance, num_decode=num_decode, num_prefill=num_prefill, link=link_preset("nvlink"),
                       local_prefill_threshold=1, max_waiting_requests=10**6)


def attainment(spec: ClusterSpec, rate: float, dataset: DatasetConfig, slo: SLO, seed: int) -> float:
    run = simulate(spec, synthetic_requests(dataset, ArrivalConfig(rate), seed), request_rate=rate)
    return summarize(run.result, slo).slo_attainment or 0.0


def max_rate(spec: ClusterSpec, dataset: DatasetConfig, slo: SLO, seed: int, steps: int) -> float:
    """The highest rate (req/s) meeting the attainment target, by bisection on a log scale."""
    low, high = 0.0, 1.0
    while attainment(spec, high, dataset, slo, seed) >= ATTAINMENT and high < 1e4:
        low, high = high, high * 2
    for _ in range(steps):
        mid = (low + high) / 2 if low else high / 2
        if attainment(spec, mid, dataset, slo, seed) >= ATTAINMENT:
            low = mid
        else:
            high = mid
    return low


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--tpot-slos-ms", default="100,60,40,30,25,20")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=7, help="bisection steps per search")
    args = ap.parse_args()
    started = time.monotonic()
    model, hardware = resolve_model(args.model), hardware_preset(args.hardware)
    latency = RooflineLatency(model=model, hardware=hardware)
    instance = InstanceSpec(latency=latency, num_blocks=30_000, max_model_len=8192,
                            kv_bytes_per_token=model.kv_bytes_per_token(KVDtype.BF16),
                            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048))
    dataset = DatasetConfig(name="random", num_prompts=args.num_prompts, input_len=1024, output_len=256,
                            range_ratio=0.5)
    rows = []
    for tpot in [float(x) for x in args.tpot_slos_ms.split(",")]:
        slo = SLO(args.ttft_slo_ms, tpot)
        per_gpu = {name: max_rate(cluster(name, instance), dataset, slo, args.seed, args.steps) / sum(UNITS[name])
                   for name in UNITS}
        best = max((n for n in UNITS if n != "colocated"), key=lambda n: per_gpu[n])
        rows.append((tpot, per_gpu, best))
        print(f"TPOT <= {tpot:.0f} ms: " + ", ".join(f"{n} {v:.2f}" for n, v in per_gpu.items()) + " req/s per GPU",
              flush=True)
    write(rows, args, time.monotonic() - started, latency.name)


def write(rows: list, args: argparse.Namespace, wall_s: float, latency: str) -> None:
    lines = ["# DistServe's result in the simulator: goodput per GPU, disaggregated vs colocated", "",
             f"Command: `{command_line('sim_distserve.py', sys.argv[1:])}`", "",
             f"Simulated (no hardware measured): {latency}; random prompts 1024 +-50% tokens, outputs 256 +-50%, "
             f"{args.num_prompts} requests per trial, Poisson arrivals, seed {args.seed}; TTFT SLO "
             f"{args.ttft_slo_ms:.0f} ms; goodput = the highest rate with >= {ATTAINMENT:.0%} of requests meeting "
             f"both SLOs, per GPU. Wall {wall_s:.0f} s.", "",
             "| TPOT SLO ms | " + " | ".join(UNITS) + " | best P:D / colocated |", "|---|" + "---|" * (len(UNITS) + 1)]
    for tpot, per_gpu, best in rows:
        factor = per_gpu[best] / per_gpu["colocated"] if per_gpu["colocated"] else float("inf")
        lines.append(f"| {tpot:.0f} | " + " | ".join(f"{per_gpu[n]:.2f}" for n in UNITS)
                     + f" | {factor:.2f}x ({best}) |")
    (RESULTS_DIR / "sim-distserve.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in UNITS:
        ax.plot([r[0] for r in rows], [r[1][name] for r in rows], marker="o", label=name)
    ax.set_xlabel("TPOT SLO (ms)")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.invert_xaxis()
    ax.legend()
    ax.set_title(f"{args.model} on {args.hardware} (simulated)")
    fig.savefig(RESULTS_DIR / "sim-distserve.png", dpi=110, bbox_inches="tight")
    print((RESULTS_DIR / "sim-distserve.md").read_text())


if __name__ == "__main__":
    main()
