"""`kvbaton plan` flags and entry point (being written)."""

from __future__ import annotations

import argparse


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return subparsers.add_parser("plan", help="(being written)")


def main(args: argparse.Namespace) -> int:
    raise NotImplementedError
