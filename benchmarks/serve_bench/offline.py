"""(d) serving overhead: kvbaton offline (`LLM.generate`) on exactly the prompts of the
saturated run, in a worker process of its own once the server is gone."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from common.contention import OverlapWatch
from common.log import log
from common.procs import thread_env
from common.records import OfflineRun, OfflineVariant
from common.workers import WorkerFailed, run_worker
from serve_bench.plan import SEED_OFFSET
from serve_bench.turns import FOREIGN_BENCH_PATTERN, over_budget, wait_turn

SCRIPT = Path(__file__).resolve().parents[1] / "bench_serve.py"
KVBATON_MAX_NUM_SEQS = 64  # kvbaton's default: a smaller served cap gets a "matched" variant


def worker_offline(args: argparse.Namespace) -> OfflineRun:
    """kvbaton `LLM.generate` on exactly the prompts of the saturated run (same dataset code, same
    seed), all submitted at once. Variants: the default engine (`LLM(model_dir, num_threads=2)`),
    and `max_num_seqs` = the served run's concurrency cap, i.e. the batch the served engine saw."""
    import torch

    from kvbaton import LLM, SamplingParams
    from kvbaton.workload.datasets import DatasetConfig, TokenizerPrompts, build_requests

    s = args.sizes
    tokenizer = TokenizerPrompts.from_dir(args.model_dir)
    cfg = DatasetConfig(name="random", num_prompts=s.sat_prompts, input_len=s.input_len, output_len=s.output_len)
    reqs = build_requests(cfg, tokenizer, args.seed + SEED_OFFSET["saturated"])
    prompts = [r.prompt for r in reqs]
    warm = build_requests(DatasetConfig(name="random", num_prompts=2, input_len=s.input_len, output_len=8),
                          tokenizer, args.seed + 1000)
    params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
    variants: dict[str, dict[str, int]] = {"default": {}}
    if s.sat_concurrency < min(KVBATON_MAX_NUM_SEQS, s.sat_prompts):
        variants["matched"] = {"max_num_seqs": s.sat_concurrency}
    done = {}
    for name, kwargs in variants.items():
        t = time.perf_counter()
        llm = LLM(args.model_dir, num_threads=args.threads, **kwargs)
        load_s = time.perf_counter() - t
        llm.engine.core.prefault_kv_pools()  # as the served worker it is compared with does
        llm.generate([r.prompt for r in warm], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs) if hasattr(outs[0], "prompt_token_ids") else None
        try:
            preemptions = llm.engine.stats().num_preemptions
        except Exception:  # not every build exposes stats()
            preemptions = None
        done[name] = OfflineVariant(kwargs=kwargs, load_s=load_s, elapsed_s=elapsed, output_tokens=n_out,
                                    prompt_tokens=n_in, output_tok_s=n_out / elapsed,
                                    torch_threads=torch.get_num_threads(), preemptions=preemptions)
        log(f"offline {name} {kwargs}: {n_out / elapsed:.1f} out tok/s ({elapsed:.1f}s)")
        del llm
    return OfflineRun(prompts=len(prompts), prompt_tokens=sum(r.prompt_len for r in reqs), variants=done)


def run_offline(args: argparse.Namespace) -> dict:
    busy = wait_turn(args, "kvbaton offline")
    if skip := over_budget(args, "kvbaton offline", 120):
        return skip
    cmd = [sys.executable, str(SCRIPT), "--_worker", "offline", "--seed", str(args.seed),
           "--threads", str(args.threads), "--model-dir", args.model_dir, "--_sizes", json.dumps(asdict(args.sizes))]
    log("kvbaton offline (LLM.generate) on the saturated prompts")
    try:
        with OverlapWatch(FOREIGN_BENCH_PATTERN) as watch:
            res = run_worker(cmd, thread_env(args.threads), 2 * args.sizes.run_cap_s + 300, what="offline worker")
    except WorkerFailed as exc:
        return {"error": str(exc)}
    return res | {"busy_before": busy, "overlap": watch.seen, "seed": args.seed + SEED_OFFSET["saturated"]}
