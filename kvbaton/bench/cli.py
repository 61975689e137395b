"""`kvbaton bench serve` flags; `serve.py` runs what they describe.

Wiring into the top-level CLI: `add_bench_parser(subparsers)` adds `bench serve`, and
`main(args)` runs a parsed `bench` command. `python -m kvbaton.bench serve ...` uses `run()`.
Heavy imports (httpx, numpy, matplotlib, transformers) wait until a command actually runs.
"""

from __future__ import annotations

import argparse
import sys

from kvbaton.workload.errors import WorkloadError
from kvbaton.workload.flags import add_dataset_args, add_load_args, add_output_args, fresh_seed, parse_rates


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


def main(args: argparse.Namespace) -> int:
    """Run a parsed `bench` command; user errors print one line and return 2."""
    from kvbaton.bench.serve import serve_benchmark

    try:
        return serve_benchmark(args, parse_rates(args), seed=args.seed if args.seed is not None else fresh_seed())
    except WorkloadError as exc:
        print(f"kvbaton bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench", description=__doc__.splitlines()[0])
    add_serve_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def run(argv: list[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))
