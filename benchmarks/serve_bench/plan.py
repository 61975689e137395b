"""What a serving run measures: the engines, the sizes, each workload's shape and seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

ENGINES = ("kvbaton", "vllm", "llamacpp")
ENGINE_LABEL = {"kvbaton": "kvbaton serve", "vllm": "vLLM CPU", "llamacpp": "llama.cpp llama-server"}


@dataclass(frozen=True, kw_only=True)
class Sizes:
    input_len: int
    output_len: int
    poisson_rate: float
    poisson_prompts: int
    sat_prompts: int
    sat_concurrency: int
    cmp_prompts: int  # (c) client cross-check
    cmp_rate: float
    warmups: int  # unmeasured requests (one by one) before the first measured run on each server
    run_cap_s: int  # --max-duration-s of every load-generator run (a bound, not a target)
    server_start_s: int


# The brief's shape is 64 requests per workload at most 32 in flight (`--num-prompts 64
# --sat-concurrency 32 --cmp-prompts 32`); on the 2-core dev box vLLM's bf16 path prefills
# ~50 tok/s, so that takes well over an hour. The default keeps the shape (512/128 tokens,
# 2 req/s, requests = 2 x the concurrency cap) at a quarter of the requests: ~30 min there.
FULL = Sizes(input_len=512, output_len=128, poisson_rate=2.0, poisson_prompts=16, sat_prompts=16,
             sat_concurrency=8, cmp_prompts=16, cmp_rate=2.0, warmups=2, run_cap_s=420, server_start_s=420)
QUICK = Sizes(input_len=128, output_len=32, poisson_rate=2.0, poisson_prompts=8, sat_prompts=8,
              sat_concurrency=4, cmp_prompts=8, cmp_rate=2.0, warmups=1, run_cap_s=180, server_start_s=420)

# workload -> seed offset from the base seed (the same prompts for every engine)
SEED_OFFSET = {"poisson": 0, "saturated": 100, "cmp-ours": 200, "cmp-vllm": 300, "cmp-ours-2": 400}
SEED_HEADROOM = 1000  # a fresh base seed leaves room for the offsets (and the offline warm-up's +1000)


@dataclass(frozen=True)
class Workload:
    rate: float  # requests/s; inf: all offered at once
    prompts: int
    concurrency: int | None  # cap on requests in flight


def workload(sizes: Sizes, name: str) -> Workload:
    s = sizes
    if name == "poisson":
        return Workload(s.poisson_rate, s.poisson_prompts, None)
    if name == "saturated":
        return Workload(math.inf, s.sat_prompts, s.sat_concurrency)
    if name in ("cmp-ours", "cmp-vllm", "cmp-ours-2"):
        return Workload(s.cmp_rate, s.cmp_prompts, None)
    raise KeyError(name)
