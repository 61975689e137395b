"""`kvbaton bench serve` flags; `serve.py` runs what they describe.

Wiring into the top-level CLI: `add_bench_parser(subparsers)` adds `bench serve`, and
`main(args)` runs a parsed `bench` command. `python -m kvbaton.bench serve ...` uses `run()`.
Heavy imports (httpx, numpy, matplotlib, transformers) wait until a command actually runs.
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys

from kvbaton.bench.errors import BenchError


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` (with its `serve` subcommand) to a top-level CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    add_serve_parser(bench.add_subparsers(dest="bench_command", required=True))
    return bench


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="open-loop load against an OpenAI-compatible endpoint",
                              description="Open-loop load generator for kvbaton serve, vLLM or llama-server.")
    _add_target_args(p.add_argument_group("server"))
    add_dataset_args(p.add_argument_group("dataset"))
    add_load_args(p.add_argument_group("load"))
    add_output_args(p.add_argument_group("SLO and output"))
    return p


def _add_target_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every answer is --output-len long")
    g.add_argument("--keepalive", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse connections (default: a fresh connection per request, which is exact)")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="longest wait for the next streamed byte")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")


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
        raise BenchError(f"--request-rates must be comma-separated numbers, got {args.request_rates!r}") from exc
    if not rates:
        raise BenchError("--request-rates is empty")
    return rates


def main(args: argparse.Namespace) -> int:
    """Run a parsed `bench` command; user errors print one line and return 2."""
    from kvbaton.bench.serve import serve_benchmark

    try:
        return serve_benchmark(args, parse_rates(args), seed=args.seed if args.seed is not None else fresh_seed())
    except BenchError as exc:
        print(f"kvbaton bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def fresh_seed() -> int:
    return secrets.randbelow(2**31)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench", description=__doc__.splitlines()[0])
    add_serve_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def run(argv: list[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))
