"""`kvbaton doctor`: the four-step diagnosis of a running deployment, with findings ranked and the flags to change.

    kvbaton doctor --url http://127.0.0.1:8000 [--api-key KEY] [--json PATH] [--skip-profile]

Findings are not errors: it exits 0 once it has a report. An unreachable server or a refused key is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from kvbaton.doctor import steps
from kvbaton.doctor.client import DeploymentClient, DoctorError
from kvbaton.doctor.findings import compute_findings, interconnect_findings, kv_findings, routing_findings
from kvbaton.doctor.report import Report, render


def add_doctor_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="diagnose a running deployment: interconnect, KV watermark, compute, "
                                             "routing; findings ranked, with the flags to change")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--api-key", default=os.environ.get("KVBATON_ADMIN_API_KEY", os.environ.get("KVBATON_API_KEY")),
                   help="the server's admin key, also sent to /v1 (default: $KVBATON_ADMIN_API_KEY, else "
                        "$KVBATON_API_KEY)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON here")
    p.add_argument("--skip-profile", action="store_true",
                   help="step 3 without the profiler capture (and without the few requests it sends)")
    p.add_argument("--transfer-mb", type=float, default=16.0, help="the large KV transfer's size (at most 128)")
    p.add_argument("--repeats", type=int, default=5, help="transfers of each size per pair (at most 20)")
    p.add_argument("--profile-steps", type=int, default=8, help="engine steps to profile per worker (at most 64)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds each probe may take (at most 120)")
    return p


def main(args: argparse.Namespace) -> int:
    opts = steps.Options(transfer_mb=args.transfer_mb, repeats=args.repeats, profile_steps=args.profile_steps,
                         timeout_s=args.timeout, skip_profile=args.skip_profile)
    dep = DeploymentClient(args.url, args.api_key)
    try:
        report = diagnose(dep, opts)
    except DoctorError as exc:
        print(f"kvbaton doctor: error: {exc}", file=sys.stderr)
        return 2
    finally:
        dep.close()
    render(report, Console())
    if args.json is not None:
        report.write_json(args.json)
    return 0


def diagnose(dep: DeploymentClient, opts: steps.Options) -> Report:
    """The four steps in order (see `steps`); DoctorError if the deployment cannot be diagnosed at all."""
    first = steps.snapshot(dep, dep.check())
    interconnect = steps.interconnect(dep, first, opts)
    time.sleep(max(0.0, steps.MIN_WINDOW_S - (time.monotonic() - first.at)))
    now = steps.snapshot(dep)  # before our traffic: what steps 2 and 4 judge
    kv = steps.kv_watermark(first, now)
    compute = steps.compute(dep, now, opts)
    routing = steps.routing(now)
    findings = (interconnect_findings(interconnect) + kv_findings(kv) + compute_findings(compute)
                + routing_findings(routing))
    return Report(dep.url, {"interconnect": interconnect, "kv": kv, "compute": compute, "routing": routing}, findings)
