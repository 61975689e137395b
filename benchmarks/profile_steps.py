"""Where an offline run's time goes, by step kind: prefill-carrying steps vs pure decode steps.

Runs bench_engine's offline workload (random 512-token prompts, 128 output tokens, ignore_eos,
greedy; for the same --seed, the very prompts of its throughput run) through `LLM.generate` and
times every model step (`ModelRunner.execute`), so a kernel change can be judged on the steps it
targets. Not a peer comparison: see bench_engine.py.

    .venv/bin/python benchmarks/profile_steps.py               # 64 prompts, bf16, 2 threads
    .venv/bin/python benchmarks/profile_steps.py --prompts 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from common.prompts import make_prompts
from kvbaton import LLM, SamplingParams
from kvbaton.engine.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, num_threads=args.threads)
    llm.engine.core.prefault_kv_pools()  # steady state: no first-touch faults in the steps measured
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p}
               for p in make_prompts(args.seed, "throughput", args.prompts, args.prompt_len, vocab)]
    steps: list[tuple[int, int, float]] = []  # (tokens, decodes, seconds)
    execute = ModelRunner.execute

    def timed(runner, sched):
        start = time.perf_counter()
        out = execute(runner, sched)
        decodes = sum(1 for s in sched.scheduled if s.num_tokens == 1)
        steps.append((sum(s.num_tokens for s in sched.scheduled), decodes, time.perf_counter() - start))
        return out

    ModelRunner.execute = timed  # NOTE: instrumentation of this process only
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True),
                        use_tqdm=False)
    wall = time.perf_counter() - start
    ModelRunner.execute = execute
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.prompts} x {args.prompt_len} -> {args.out_len}: {wall:.1f} s, {generated / wall:.1f} out tok/s, "
          f"{len(steps)} steps, {sum(t for *_, t in steps):.1f} s in the model runner")
    prefill = [(n, d, t) for n, d, t in steps if n > d]
    prefill_s = [t for *_, t in prefill]
    print(f"steps with prefill: {len(prefill)}, {sum(prefill_s):.1f} s for {sum(n - d for n, d, _ in prefill)} "
          f"prompt tokens; median {statistics.median(prefill_s):.2f} s")
    by_batch: dict[int, list[float]] = defaultdict(list)
    for n, d, t in steps:
        if n == d:
            by_batch[d].append(t)
    total = sum(sum(v) for v in by_batch.values())
    print(f"pure decode steps: {sum(len(v) for v in by_batch.values())}, {total:.1f} s; median ms by batch:")
    for batch in sorted(by_batch, key=lambda b: -len(by_batch[b]))[:5]:
        median_ms = 1e3 * statistics.median(by_batch[batch])
        print(f"  {batch:3d} requests: {len(by_batch[batch]):4d} steps, {median_ms:.0f} ms")


if __name__ == "__main__":
    main()
