#!/usr/bin/env python
"""`kvbaton plan`'s worked examples, committed: the article's Llama-3-70B incident on H800s (diagnosed), a
Llama-3-8B plan on H100s and a DeepSeek-V3 (MLA, MoE, EP) plan on H200s (searched).

Each example is simulated (the real scheduler over a roofline step-latency model, no GPU needed) and written
to benchmarks/results/plan/<example>.md (the printed report, plus tables), <example>.json and
<example>/*.png. Nothing here runs a model.

    .venv/bin/python benchmarks/plan_examples.py                      # all three, 60 s windows (~15-25 min)
    .venv/bin/python benchmarks/plan_examples.py --examples article --window-s 20
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path

from rich.console import Console

from common.machine import kvbaton_commit
from common.report import command_line
from kvbaton.plan.evaluate import SimOptions
from kvbaton.plan.examples import EXAMPLES
from kvbaton.plan.run import run_scenario

OUT_DIR = Path("benchmarks/results/plan") if Path("benchmarks/plan_examples.py").exists() else \
    Path(__file__).parent / "results" / "plan"  # relative when run from the repository root, as the paths printed


def run_example(name: str, options: SimOptions, command: str) -> float:
    scenario = EXAMPLES[name]
    console = Console(record=True, width=170, force_terminal=False, color_system=None)
    started = time.perf_counter()
    run_scenario(scenario, options, console, lambda line: print(f"  {name}: {line}", flush=True),
                 json_path=str(OUT_DIR / f"{name}.json"), plot_dir=str(OUT_DIR / name))
    wall = time.perf_counter() - started
    text = console.export_text()
    plots = sorted((OUT_DIR / name).glob("*.png"))
    md = [f"# kvbaton plan --example {name}: {scenario.title}", "",
          f"Command: `{command}` (this example: `kvbaton plan --example {name} --window-s {options.window_s:g} "
          f"--seed {options.seed}`)  ",
          f"Run {dt.datetime.now().isoformat(timespec='seconds')}, kvbaton commit {kvbaton_commit()}, "
          f"{wall:.0f} s of simulation on the 2-vCPU dev machine. Simulated: the real scheduler over the roofline "
          "step-latency model (`kvbaton/sim/roofline.py`), no GPU involved; figures are a model's, see "
          "`kvbaton/sim/hardware.py` for the efficiencies assumed.", "",
          "```text", text.rstrip(), "```", "",
          *[f"![{p.stem}]({name}/{p.name})" for p in plots], "",
          f"Raw result: `{name}.json`.", ""]
    (OUT_DIR / f"{name}.md").write_text("\n".join(md))
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES), help=f"comma-separated among {', '.join(EXAMPLES)}")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    options = SimOptions(window_s=args.window_s, seed=args.seed)
    command = command_line("plan_examples.py", [f"--examples={args.examples}",
                                                           f"--window-s={args.window_s:g}", f"--seed={args.seed}"])
    for name in args.examples.split(","):
        wall = run_example(name.strip(), options, command)
        print(f"{name}: {wall:.0f} s -> {OUT_DIR / name}.md")


if __name__ == "__main__":
    main()
