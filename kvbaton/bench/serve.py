"""One `bench serve` invocation: build the dataset once, run it at each request rate, report.

Every rate of a sweep replays the same requests (same seed), so rates differ only in load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

from rich.console import Console
from rich.markup import escape

from kvbaton.bench.client import Target, fetch_model_name
from kvbaton.bench.runner import run_load
from kvbaton.workload.arrivals import ArrivalConfig
from kvbaton.workload.datasets import DatasetConfig, PromptSource, TokenizerPrompts, WordPrompts, build_requests
from kvbaton.workload.errors import WorkloadError
from kvbaton.workload.flags import dataset_config
from kvbaton.workload.metrics import SLO, Summary, summarize
from kvbaton.workload.records import RunResult
from kvbaton.workload.report import print_report, rate_label, result_document, write_result_json


def serve_benchmark(args: argparse.Namespace, rates: list[float], seed: int) -> int:
    """Run the sweep described by `args`; 0 if any request completed, else 1."""
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    dataset = dataset_config(args)
    arrivals = [ArrivalConfig(rate, args.arrival, args.burstiness, args.max_concurrency) for rate in rates]
    if args.max_duration_s is not None and args.max_duration_s <= 0:
        raise WorkloadError("--max-duration-s must be positive")
    target = build_target(args)
    console = _console()
    console.print(f"kvbaton bench serve: seed {seed}, model {target.model!r}, {target.url}, "
                  f"dataset {dataset.name} x {dataset.num_prompts}, rates {', '.join(map(rate_label, rates))}")
    source = prompt_source(args.tokenizer)
    requests = build_requests(dataset, source, seed)
    _warm_up(target, dataset, source, seed, args.num_warmups)
    results = [_run_one(target, requests, a, seed, args) for a in arrivals]
    summaries = [summarize(r, slo) for r in results]
    print_report(summaries, slo, console)
    _write_outputs(args, _config_dict(args, rates, seed, target), results, summaries, slo, console)
    if not any(s.completed for s in summaries):
        first_error = next((r.error for res in results for r in res.records if r.error), "-")
        console.print(f"[red]no request completed[/red]; first error: {escape(first_error)}")
        return 1
    return 0


def _console() -> Console:
    console = Console()
    # NOTE: rich falls back to 80 columns when piped, which truncates the sweep table in logs.
    return console if console.is_terminal else Console(width=140)


def _warm_up(target: Target, dataset: DatasetConfig, source: PromptSource, seed: int, num_warmups: int) -> None:
    """Send a few unmeasured requests, one at a time, so a cold server does not skew the first rate.
    They come from another seed: reusing the measured prompts would pre-fill the prefix cache."""
    if num_warmups > 0:
        warmups = build_requests(replace(dataset, num_prompts=num_warmups), source, seed + 1)
        asyncio.run(run_load(target, warmups, ArrivalConfig(max_concurrency=1), seed, show_progress=False))


def _run_one(target: Target, requests: list, arrivals: ArrivalConfig, seed: int,
             args: argparse.Namespace) -> RunResult:
    return asyncio.run(run_load(target, requests, arrivals, seed, args.max_duration_s, not args.no_progress))


def build_target(args: argparse.Namespace) -> Target:
    extra_body = _parse_extra_body(args.extra_body)
    model = args.model or fetch_model_name(args.base_url, args.api_key)
    return Target(base_url=args.base_url, endpoint=args.endpoint, model=model, api_key=args.api_key,
                  ignore_eos=args.ignore_eos, keepalive=args.keepalive, extra_body=extra_body,
                  timeout_s=args.request_timeout_s)


def prompt_source(tokenizer_dir: str | None) -> PromptSource:
    if tokenizer_dir is None:
        return WordPrompts()
    try:
        return TokenizerPrompts.from_dir(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot load a tokenizer from {tokenizer_dir!r}: {exc}") from exc


def _parse_extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"--extra-body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise WorkloadError("--extra-body must be a JSON object")
    return body


def _config_dict(args: argparse.Namespace, rates: list[float], seed: int, target: Target) -> dict:
    scalars = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    scalars["api_key"] = "<redacted>" if args.api_key else None  # result files get shared; keys must not
    return {**scalars, "seed": seed, "model": target.model, "request_rates": rates,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _write_outputs(args: argparse.Namespace, config: dict, results: list[RunResult], summaries: list[Summary],
                   slo: SLO, console: Console) -> None:
    if args.result_json:
        write_result_json(args.result_json, result_document(config, results, summaries))
        console.print(f"results: {args.result_json}")
    if args.plot_dir:
        from kvbaton.workload.plots import write_plots

        for path in write_plots(args.plot_dir, results, summaries, slo):
            console.print(f"plot: {path}")
