"""Writing a run down: the JSON of every figure, the markdown summary, and their pieces."""

from __future__ import annotations

import datetime as dt
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.log import log

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def notes_section(notes: list[str]) -> list[str]:
    return ["", "Notes:", *[f"- {n}" for n in notes]] if notes else []


def command_line(script: str, argv: list[str]) -> str:
    """The command as the summary shows it, to repeat the run."""
    return shlex.join(["python", f"benchmarks/{script}", *argv])


def stamp(started: dt.datetime) -> str:
    return started.strftime("%Y-%m-%d-%H%M%S")


@dataclass(frozen=True)
class ResultFiles:
    """`<prefix>-<stamp>.json` (every figure of this run) and `<prefix>.md` (the latest summary);
    a `--quick` run's prefix has `-quick`, so that a smoke run never overwrites a full one."""

    json: Path
    md: Path

    @classmethod
    def of(cls, out_dir: Path, prefix: str, run_stamp: str) -> ResultFiles:
        out_dir.mkdir(parents=True, exist_ok=True)
        return cls(json=out_dir / f"{prefix}-{run_stamp}.json", md=out_dir / f"{prefix}.md")

    def write_json(self, doc: dict[str, Any]) -> None:
        write_json(self.json, doc)

    def write(self, doc: dict[str, Any], md: str, wall_s: float) -> None:
        """Both files, and the summary on stdout."""
        self.write_json(doc)
        self.md.write_text(md)
        print(md)
        log(f"wrote {self.json} and {self.md} in {wall_s / 60:.1f} min")


def write_json(path: Path, doc: dict[str, Any], indent: int = 2) -> None:
    path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")  # default=str: paths


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
