"""EPLB in the AFD expert pool: does re-placing experts mid-stream stall decoding, and does it even out the pool?

    .venv/bin/python benchmarks/bench_afd_eplb.py            # ~2 min on 2 cores

bench_afd.py's random-weight Qwen3-MoE (64 experts, top-8, 8 MoE layers, bf16) with its router skewed: the gate
rows of experts 0-7 are scaled by `--skew`, so those experts (all on expert worker 0 under the first, contiguous
placement) take far more tokens than the rest, as hot experts do in real traffic. One attention engine (1 thread,
m = 2) decodes a batch over a pool of 2 expert workers (1 thread each, `--redundant` spare slots), fresh
processes per run, twice: EPLB off (the peer: the same deployment and traffic) and EPLB on (a plan every
`--interval` busy steps, by the attention engine). Per run: decode throughput (median step), step-time p50/p99/max,
the steps where a new placement was switched to (their time over the median: the stall, if any), and how evenly
the two expert workers shared the rows (max / mean, 1.0 = even), and the steps slower than 1.4x the median (each
repeat's first, the prefill, is one in both runs). The machine has 2 cores for 3 busy processes:
compare the two runs, not the absolute figures. Output: `benchmarks/results/afd-eplb-<stamp>.json` and
`benchmarks/results/afd-eplb.md`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_afd import SECRET, build_model
from common.log import log
from common.machine import environment
from common.procs import run_job_child, stop_pids, thread_env
from common.prompts import fresh_seed, make_prompts
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, fmt, ratio, stamp
from moe_ep_bench.models import DECODE_PROMPT, SHAPE

RESULT_PREFIX = "afd-eplb"
HOT = range(8)  # the experts whose gate rows are scaled
SLOW = 1.4  # a step this many times the median is counted slow (each repeat's first, prefill included, is)


def skew_gate(model_dir: Path, factor: float) -> None:
    """Scale every MoE layer's gate rows of the HOT experts by `factor` (their logits spread wider, so they win
    the top-k far more often)."""
    from safetensors.torch import load_file, save_file

    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensor[list(HOT)] *= factor
        save_file(tensors, str(path), metadata={"format": "pt"})


def run_attention(job: dict) -> dict:
    """The attention engine over the pool: every step's wall time and the placement epoch it ran at."""
    from kvbaton import LLM, SamplingParams
    from kvbaton.config import AttentionFFNConfig

    afd = AttentionFFNConfig(experts=tuple(job["experts"]), micro_batches=2,
                             rebalance_interval_steps=job["interval"])
    llm = LLM(job["model"], dtype="bfloat16", num_threads=1, max_model_len=512, kv_cache_memory_gb=0.5,
              attention_ffn=afd, max_num_seqs=max(64, job["batch"]))
    core = llm.engine.core
    pool = core.expert_pool
    steps: list[list[float]] = []
    real_step = core.step

    def step():
        t = time.perf_counter()
        result = real_step()
        steps.append([time.perf_counter() - t, pool.epoch, core.scheduler.num_running])
        return result

    core.step = step
    for repeat in range(job["repeats"]):
        prompts = make_prompts(job["seed"], f"eplb-{repeat}", job["batch"], DECODE_PROMPT, SHAPE["vocab_size"])
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=job["tokens"], ignore_eos=True))
    core.close()
    return {"steps": steps, "rebalances": pool.rebalances, "epoch": pool.epoch}


def run(model: Path, interval: int, args: argparse.Namespace, seed: int) -> dict:
    env = thread_env(1) | {"KVBATON_CLUSTER_SECRET": SECRET}
    experts = [subprocess.Popen([sys.executable, "-m", "kvbaton.parallel.afd.standalone", json.dumps(
        {"model": str(model), "rank": r, "size": 2, "dtype": "bfloat16", "threads": 1, "redundant": args.redundant})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        addresses = [json.loads(p.stdout.readline())["address"] for p in experts]  # type: ignore[union-attr]
        job = {"model": str(model), "experts": addresses, "interval": interval, "batch": args.batch,
               "tokens": args.decode_tokens, "repeats": args.repeats, "seed": seed}
        result = run_job_child(__file__, job, env, args.job_timeout_s, f"EPLB interval {interval}")
        result["expert_rows"] = [json.loads(p.communicate("", timeout=30)[0].strip().splitlines()[-1])["rows"]
                                 for p in experts]
        return {"interval": interval, **result}
    finally:
        stop_pids([p.pid for p in experts if p.poll() is None])


def summarize(result: dict, batch: int) -> dict:
    decode = [s for s in result["steps"] if s[2] == batch]  # steps where the whole batch decodes
    walls = sorted(s[0] for s in decode)
    median = statistics.median(walls)
    switches = [s[0] for prev, s in zip(result["steps"], result["steps"][1:]) if s[1] != prev[1]]
    rows = result["expert_rows"]
    return {"tok_s": batch / median, "p50_ms": median * 1e3, "p99_ms": walls[int(0.99 * (len(walls) - 1))] * 1e3,
            "max_ms": walls[-1] * 1e3, "switches": len(switches), "slow_steps": sum(w > SLOW * median for w in walls),
            "switch_over_median": max(switches) / median if switches else None,
            "rows_max_over_mean": max(rows) / statistics.mean(rows) if sum(rows) else None, "rows": rows}


def render(run_: dict) -> str:
    off, on = (summarize(r, run_["batch"]) for r in run_["runs"])
    env = run_["environment"]
    lines = [f"# EPLB in the AFD expert pool ({run_['started']})", "",
             f"`{run_['command']}` on {env['cpu']} ({env['cpu_features']}), {env['cpus']} cores, kvbaton "
             f"{env['kvbaton_commit']}; seed {run_['seed']}; batch {run_['batch']}, "
             f"{run_['decode_tokens']} decode tokens x {run_['repeats']}; gate rows of experts 0-7 x{run_['skew']:g}; "
             f"2 expert workers (1 thread each, {run_['redundant']} redundant slots), 1 attention engine (1 thread, "
             "m = 2)", "",
             "| EPLB | decode tok/s | step p50 ms | p99 ms | max ms | steps > 1.4x p50 | placements switched to | "
             "slowest switch step / p50 | rows on the busier expert worker / mean |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in (("off", off), (f"every {run_['interval']} steps", on)):
        lines.append(f"| {name} | {fmt(s['tok_s'])} | {fmt(s['p50_ms'], '.2f')} | {fmt(s['p99_ms'], '.2f')} | "
                     f"{fmt(s['max_ms'], '.2f')} | {s['slow_steps']} | {s['switches']} | "
                     f"{fmt(s['switch_over_median'], '.2f')} | "
                     f"{fmt(s['rows_max_over_mean'], '.2f')} |")
    lines += ["", f"EPLB on / off: throughput {fmt(ratio(on['tok_s'], off['tok_s']), '.2f')}x, "
              f"step p99 {fmt(ratio(on['p99_ms'], off['p99_ms']), '.2f')}x. Rows per expert worker: off "
              f"{off['rows']}, on {on['rows']} (with EPLB on, the first placement's skew is paid until the first "
              "switch). No step waits for a placement to load: the expert workers load on a thread of their own and "
              "the attention engine switches once they hold it; the steps that run while a load does are slower "
              "here because the loader competes for the same 2 cores as 3 busy processes (the slow steps beyond the "
              "EPLB-off run's are those)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--skew", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--job-timeout-s", type=float, default=600.0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_attention(json.loads(args.run))))
        return
    started, t0 = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    seed = args.seed if args.seed is not None else fresh_seed()
    log(f"seed {seed}")
    with tempfile.TemporaryDirectory(prefix="kvbaton-bench-afd-eplb-") as tmp:
        model = build_model(Path(tmp), seed)
        skew_gate(model, args.skew)
        runs = []
        for interval in (0, args.interval):
            log(f"EPLB interval {interval}")
            runs.append(run(model, interval, args, seed))
    run_ = {"command": command_line("bench_afd_eplb.py", sys.argv[1:]),
            "started": started.strftime("%Y-%m-%d %H:%M UTC"), "seed": seed,
            "environment": to_json(environment()), "batch": args.batch, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats, "interval": args.interval, "redundant": args.redundant, "skew": args.skew,
            "runs": runs, "wall_s": time.perf_counter() - t0}
    ResultFiles.of(args.out_dir, RESULT_PREFIX, stamp(started)).write(run_, render(run_), run_["wall_s"])


if __name__ == "__main__":
    main()
