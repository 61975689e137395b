"""`kvbaton sim` flags and entry point (being written)."""

from __future__ import annotations

import argparse


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sim = subparsers.add_parser("sim", help="simulate a deployment on the real scheduler (no model runs)")
    sub = sim.add_subparsers(dest="sim_command", required=True)
    sub.add_parser("run", help="simulate a load")
    sub.add_parser("profile", help="measure this machine's engine steps and fit a step-latency model")
    return sim


def main(args: argparse.Namespace) -> int:
    raise NotImplementedError
