#!/usr/bin/env python
"""Achieved weight bandwidth of every linear-layer code path on this CPU, shape by shape, against the
machine's read bandwidth (the roofline of a decode step) and PyTorch's own GEMM (oneDNN / MKL) as the
peer measured in the same run; then the model's whole decode step per path.

The shapes are the default model's (SmolLM2-135M: hidden 576, intermediate 1536, vocab 49152), each
weight cold: a layer's weights are cycled through as many copies as one decode step streams (30
layers; one lm_head), so no copy is still in cache when it is read again. Rows: 1 (batch-1 decode),
4 and 8 (small decode batches), 32 (a decode batch), 512 (a prefill chunk).

    .venv/bin/python benchmarks/bench_linear_kernels.py              # writes results/linear-kernels.md
    .venv/bin/python benchmarks/bench_linear_kernels.py --rows 1,4
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from common.machine import cpu_name, kvbaton_commit, measure_bandwidth
from common.report import RESULTS_DIR, command_line
from kvbaton.kernels import dot_linear, pack_amx, pack_linear, small_batch_linear
from kvbaton.kernels.linear import amx_enabled
from kvbaton.platform.compute import choose_compute_plan
from kvbaton.platform.cpu import detect_cpu

SHAPES = {"qkv_proj": (960, 576, 30), "o_proj": (576, 576, 30), "gate_up_proj": (3072, 576, 30),
          "down_proj": (576, 1536, 30), "lm_head": (49152, 576, 1)}  # name -> (N, K, layers per step)


def kernels(rows: int) -> dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """path name -> (weight -> (x -> y)), for the paths this CPU runs at this row count."""
    cpu = detect_cpu()
    out: dict[str, Callable] = {"pytorch (oneDNN)": lambda w: lambda x: F.linear(x, w)}
    if cpu.avx512_bf16:
        dot = dot_linear(True, max_rows=None)
        out["dot-avx512bf16"] = lambda w: lambda x: dot(x, w, None)
    if cpu.amx_bf16 and amx_enabled():
        out["amx"] = lambda w: (lambda p: lambda x: p(x))(pack_amx(w, None, None))
    generic = dot_linear(False, max_rows=None)
    out["dot-generic (deterministic, AVX2)"] = lambda w: lambda x: generic(x, w, None)
    if rows <= 8:
        stream = small_batch_linear()
        out["stream-avx2"] = lambda w: lambda x: stream(x, w, None)
    out["packed (AVX2)"] = lambda w: (lambda p: lambda x: p(x))(pack_linear(w, None, torch.bfloat16))
    return out


def measure(n: int, k: int, copies: int, rows: int, make: Callable, reps: int) -> float:
    """Seconds per call, weights cold (cycled through `copies` copies)."""
    weights = [torch.randn(n, k).bfloat16() for _ in range(max(copies, 1))]
    calls = [make(w) for w in weights]
    x = torch.randn(rows, k).bfloat16()
    for call in calls[:2]:
        call(x)
    start = time.perf_counter()
    for _ in range(reps):
        for call in calls:
            call(x)
    return (time.perf_counter() - start) / (reps * len(calls))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,32,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS_DIR / "linear-kernels.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = measure_bandwidth(512, args.threads).read_gb_s
    cpu = detect_cpu()
    lines = [f"# Linear-layer kernels — {dt.datetime.now().isoformat(timespec='seconds')}", "",
             f"Command: `{command_line('bench_linear_kernels.py', sys.argv[1:])}`  ",
             f"Machine: {cpu_name()}; kvbaton sees {cpu.summary()}; {args.threads} threads; kvbaton commit "
             f"{kvbaton_commit()}; torch {torch.__version__}", "",
             f"Read bandwidth (torch sum of 512 MB): {bw:.1f} GB/s. The table's row here: "
             f"{choose_compute_plan(cpu, 'bfloat16').summary()}", "",
             "Weight GB/s achieved (weight bytes / time; for 32 and 512 rows compute-bound, so read it as speed); "
             "per-step ms = the whole model's linears for one step of that many rows.", ""]
    for rows in (int(r) for r in args.rows.split(",")):
        paths = kernels(rows)
        lines += [f"### {rows} row{'s' if rows > 1 else ''}", "",
                  "| path | " + " | ".join(SHAPES) + " | step ms | ÷ oneDNN step |",
                  "|---|" + "---:|" * (len(SHAPES) + 2)]
        steps: dict[str, float] = {}
        for name, make in paths.items():
            cells, step = [], 0.0
            for n, k, layers in SHAPES.values():
                copies = layers if rows <= 32 else 2
                sec = measure(n, k, copies, rows, make, args.reps if rows <= 32 else 1)
                step += sec * layers
                cells.append(f"{n * k * 2 / sec / 1e9:.1f}")
            steps[name] = step
            base = steps.get("pytorch (oneDNN)")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {step * 1e3:.1f} | "
                         f"{base / step if base else 1:.2f}× |")
            print(lines[-1], flush=True)
        weights_mb = sum(n * k * 2 * layers for n, k, layers in SHAPES.values()) / 1e6
        lines += ["", f"Roofline for one step: {weights_mb:.0f} MB / {bw:.1f} GB/s = {weights_mb / bw:.1f} ms.", ""]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
