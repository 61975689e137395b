"""The flags a workload is described by, shared by `kvbaton bench serve` and `kvbaton sim run`: the dataset,
the load (rates, arrivals) and the SLO/output options, and the configs they make."""

from __future__ import annotations

import argparse
import math
import secrets

from kvbaton.workload.datasets import DatasetConfig
from kvbaton.workload.errors import WorkloadError


def add_dataset_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "mixed"])
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", type=int, default=1024, help="random; shared-prefix: the part after the prefix")
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens per system prompt")
    g.add_argument("--long-fraction", type=float, default=0.05, help="mixed: fraction of long prompts")
    g.add_argument("--long-input-len", type=int, default=4096)
    g.add_argument("--short-input-len", type=int, default=128)
    g.add_argument("--tokenizer", default=None, help="tokenizer dir: prompts of random token ids (else random words)")
    g.add_argument("--seed", type=int, default=None, help="dataset and arrival seed (default: fresh, printed)")


def add_load_args(g: argparse._ArgumentGroup) -> None:
    rates = g.add_mutually_exclusive_group()
    rates.add_argument("--request-rate", type=float, default=math.inf, help="req/s (default inf: all at once)")
    rates.add_argument("--request-rates", default=None, help="comma-separated sweep, e.g. 1,2,4")
    g.add_argument("--arrival", default="poisson", choices=["poisson", "constant"])
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--max-duration-s", type=float, default=None, help="stop each rate's run after this long")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent one by one first")


def add_output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--result-json", default=None, help="write config, seed, per-request records and summaries")
    g.add_argument("--plot-dir", default=None, help="write latency CDF (and rate-sweep) PNGs here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_rates(args: argparse.Namespace) -> list[float]:
    if args.request_rates is None:
        return [args.request_rate]
    try:
        rates = [float(r) for r in args.request_rates.split(",") if r.strip()]
    except ValueError as exc:
        raise WorkloadError(f"--request-rates must be comma-separated numbers, got {args.request_rates!r}") from exc
    if not rates:
        raise WorkloadError("--request-rates is empty")
    return rates


def fresh_seed() -> int:
    return secrets.randbelow(2**31)


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        long_fraction=args.long_fraction, long_input_len=args.long_input_len, short_input_len=args.short_input_len,
    )
