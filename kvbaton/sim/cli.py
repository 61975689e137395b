"""`kvbaton sim` flags and entry point: `run` simulates a load; `profile` (run by kvbaton.cli, since it
measures the real engine) fits a step-latency model to this machine.

The load flags are `kvbaton bench serve`'s own (dataset, arrivals, SLOs, outputs), so a simulated
run and a measured one are described by the same command line. Heavy imports wait for `main`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvbaton.workload.flags import add_dataset_args, add_load_args, add_output_args

if TYPE_CHECKING:
    from kvbaton.sim.profiled import ProfileFit


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sim = subparsers.add_parser("sim", help="simulate a deployment on the real scheduler (no model runs)")
    sub = sim.add_subparsers(dest="sim_command", required=True)
    run = sub.add_parser("run", help="simulate a load against a deployment",
                         description="Discrete-event simulation: the real scheduler, KV cache manager and routing "
                                     "policies, with a step-latency model in place of the model.")
    _add_deployment_args(run.add_argument_group("deployment"))
    _add_instance_args(run.add_argument_group("each instance (worker)"))
    add_dataset_args(run.add_argument_group("dataset (as kvbaton bench serve)"))
    run.add_argument("--trace", default=None, metavar="RESULT_JSON",
                     help="replay a `kvbaton bench serve --result-json` run (send times and lengths) instead")
    add_load_args(run.add_argument_group("load (as kvbaton bench serve)"))
    add_output_args(run.add_argument_group("SLO and output"))
    calibrate = sub.add_parser("calibrate", help="measure what serving adds to the engines (for --host-overhead)",
                               description="From one measured `kvbaton bench serve --result-json` run against a "
                                           "server started with --step-trace: each role's served steps over the "
                                           "profile's prediction, and per prompt size the median delay of the "
                                           "run's first tokens beyond its replay with those steps.")
    _add_deployment_args(calibrate.add_argument_group("deployment (as the measured run's server)"))
    _add_instance_args(calibrate.add_argument_group("each instance (worker)"))
    calibrate.add_argument("--trace", required=True, metavar="RESULT_JSON", help="the measured run")
    calibrate.add_argument("--step-trace", required=True, nargs="+", metavar="TRACE",
                           help="its server's `--step-trace` directory (or steps-*.jsonl files)")
    calibrate.add_argument("--out", required=True, metavar="PATH", help="where the host-overhead JSON goes")
    refit = sub.add_parser("refit", help="fit a profile's measured steps again (today's model forms), no measuring")
    refit.add_argument("profile", metavar="PROFILE_JSON", help="a `kvbaton sim profile` file")
    refit.add_argument("--out", default=None, metavar="PATH", help="write here instead of over PROFILE_JSON")
    fit_steps = sub.add_parser("fit-steps", help="fit a step profile to served steps (`serve --step-trace`)",
                               description="Fit a step-latency model to the steps a served deployment traced "
                                           "(`kvbaton serve --step-trace DIR`), and compare them with a profile.")
    fit_steps.add_argument("traces", nargs="+", metavar="TRACE",
                           help="steps-*.jsonl files, or directories of them (one engine configuration's)")
    fit_steps.add_argument("--out", default=None, metavar="PATH", help="where the fitted profile goes")
    fit_steps.add_argument("--compare", default=None, metavar="PROFILE_JSON",
                           help="say how the served steps compare with this profile's prediction, per kind of step")
    _add_profile_args(sub.add_parser("profile", help="measure this machine's engine steps and fit a step-latency "
                                                     "model"))
    return sim


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir, .gguf file (default: the default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--no-kernels", action="store_true", help="PyTorch ops only, without kvbaton's C CPU kernels")
    p.add_argument("--compute-path", default="auto", help="as kvbaton serve's (default: chosen from this CPU)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0,
                   help="the profiling engine's KV pool (grid points that do not fit it are skipped)")
    p.add_argument("--out", required=True, metavar="PATH", help="where the JSON profile goes")
    p.add_argument("--quick", action="store_true", help="a few grid points (tests, a first look)")
    # NOTE: the profiler is the engine's, and the engine layer may not import the simulator: the parser hands
    # it the simulator's side (step shape, fit), imported only when a profile runs.
    p.set_defaults(profile_fit=_profile_fit)


def _profile_fit() -> ProfileFit:
    from kvbaton.sim.profiled import ProfileFit

    return ProfileFit()


def _add_deployment_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--prefill", type=int, default=0, help="prefill instances (0: decode instances prefill)")
    g.add_argument("--decode", type=int, default=1, help="decode instances (colocated replicas with --prefill 0)")
    g.add_argument("--link", default="host-shm", help="KV link preset between P and D (see kvbaton.sim.links)")
    g.add_argument("--link-gbps", type=float, default=None, help="a custom link: effective Gbit/s")
    g.add_argument("--link-latency-us", type=float, default=None, help="a custom link: latency per transfer")
    g.add_argument("--routing", default="least_loaded", choices=["round_robin", "least_loaded", "prefix_aware"])
    g.add_argument("--local-prefill-threshold", type=int, default=64)
    g.add_argument("--max-waiting-requests", type=int, default=256)
    g.add_argument("--host-overhead", default=None, metavar="JSON",
                   help="what serving adds (dispatch delay, served steps), from `kvbaton sim calibrate` (default: "
                        "the engines alone)")


def _add_instance_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--profile", default=None, metavar="JSON",
                   help="step-latency model: a `kvbaton sim profile` file (this machine, measured)")
    g.add_argument("--hardware", default=None, help="step-latency model: a roofline of this hardware preset")
    g.add_argument("--model-preset", default=None, help="with --hardware: a model preset or an HF config.json")
    g.add_argument("--tp", type=int, default=1, help="with --hardware: tensor-parallel size of an instance")
    g.add_argument("--pp", type=int, default=1, help="with --hardware: pipeline-parallel size of an instance")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (default: from the profile)")
    g.add_argument("--kv-bytes-per-token", type=int, default=None, help="default: from the profile or model")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")


def main(args: argparse.Namespace) -> int:
    """Run a parsed `sim run` or `sim calibrate`; user errors print one line and return 2."""
    from kvbaton.config import ConfigError
    from kvbaton.sim.run import run_calibration, run_simulation
    from kvbaton.workload.errors import WorkloadError

    try:
        if args.sim_command == "refit":
            return _refit(args)
        if args.sim_command == "fit-steps":
            return _fit_steps(args)
        return run_calibration(args) if args.sim_command == "calibrate" else run_simulation(args)
    except (WorkloadError, ConfigError, ValueError, OSError) as exc:
        print(f"kvbaton sim: error: {exc}", file=sys.stderr)
        return 2


def _refit(args: argparse.Namespace) -> int:
    from kvbaton.sim.profiled import refit_profile

    model = refit_profile(args.profile, args.out)
    error = model.fit_error
    held_out = f", held-out error median {error.median_ape:.1%}, p90 {error.p90_ape:.1%}" if error else ""
    print(f"{model.form}{held_out} -> {args.out or args.profile}")
    return 0


def _fit_steps(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvbaton.sim.profiled import ProfiledLatency
    from kvbaton.sim.served_steps import compare, fit_steps, read_traces

    if args.out is None and args.compare is None:
        raise ValueError("fit-steps needs --out (write the fitted profile) or --compare (compare with a profile)")
    reference = ProfiledLatency.load(args.compare) if args.compare else None  # a bad file fails before the fit
    traced = read_traces(args.traces)
    skipped = f" ({traced.lines_skipped} lines that are not a step skipped)" if traced.lines_skipped else ""
    print(f"{len(traced.steps)} steps from {len(traced.files)} trace files{skipped}")
    if args.out:
        profile = fit_steps(traced)
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
        model = ProfiledLatency.from_dict(profile["latency_model"])
        error = model.fit_error
        held_out = f", held-out error median {error.median_ape:.1%}, p90 {error.p90_ape:.1%}" if error else ""
        print(f"{profile['source']['distinct_shapes_fitted']} distinct shapes: {model.form}{held_out} -> {args.out}")
    if reference is not None:
        print(f"served steps over {args.compare}'s prediction for their shapes:")
        for row in compare(traced.steps, reference):
            print(f"  {row.describe()}")
    return 0
