#!/usr/bin/env python
"""Where a batch-1 decode step's time goes: the C layer loop against the Python one, and both against the
weight stream alone, in one process.

Measured on the default model (bf16, the CPU's compute path), one fresh random 512-token prompt per round,
64 greedy output tokens; the C and Python loops alternate round by round (the host's noise hits both).
Reported: the model forward's median per loop, the weight stream alone (every linear's kernel back to
back, one row, no Python between but ctypes), the time outside the weight stream per step, and the read
roofline (weights + KV at the mean context, at this machine's measured read bandwidth), also per round at the
bandwidth measured just before and after it. Peers are bench_engine.py's.

    .venv/bin/python benchmarks/bench_decode_step.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.machine import measure_bandwidth, model_facts, read_gb_s_now, roofline
from kvbaton.engine.llm import LLM
from kvbaton.kernels.linear import DotLinear, SmallBatchLinear
from kvbaton.layers.linear import Linear
from kvbaton.models.decoder import DecoderStack
from kvbaton.models.registry import pull_default_model
from kvbaton.platform.cpu import detect_cpu
from kvbaton.sched.sampling_params import SamplingParams

PROMPT, OUT = 512, 64


def weight_stream_ms(model: torch.nn.Module) -> float:
    """Every linear's rows kernel back to back on one row: the weights read once, nothing else (best of 20)."""
    calls = []
    for lin in (m for m in model.modules() if isinstance(m, Linear)):
        kernel = lin.rows_kernel
        x = torch.randn(1, lin.in_features).to(lin.weight.dtype)
        if isinstance(kernel, DotLinear | SmallBatchLinear):
            calls.append((kernel, x, lin))
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter_ns()
        for kernel, x, lin in calls:
            kernel(x, lin.weight, lin.bias)
        best = min(best, time.perf_counter_ns() - t)
    return best / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(dtype="bfloat16")
    llm.engine.core.prefault_kv_pools()  # steady state: no first-touch faults in the steps measured
    core = llm.engine.core
    model = core.runner.model
    loop = model.layer_loop
    forwards: list[int] = []
    original = DecoderStack.forward

    def timed(self, input_ids, *rest, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter_ns()
        out = original(self, input_ids, *rest, **kw)
        if input_ids.numel() == 1:
            forwards.append(time.perf_counter_ns() - t)
        return out

    DecoderStack.forward = timed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(int(time.time()))
    params = SamplingParams(max_tokens=OUT, ignore_eos=True, temperature=0.0)
    medians: dict[str, list[float]] = {"C loop": [], "Python loop": []}
    # the read bandwidth just before and after each round's run: this host's jumps between ~48 and ~80 GB/s
    # within minutes, so each run also gets the roofline of its own moment (the higher of the two)
    moments: dict[str, list[float]] = {name: [] for name in medians}
    probe = torch.ones(2**28)  # 1 GiB of fp32, as measure_bandwidth's
    probe.sum()
    for r in range(args.rounds + 1):  # the first round warms both up
        for name in medians:
            model.layer_loop = loop if name == "C loop" else None
            forwards.clear()
            prompt = torch.randint(100, 40000, (PROMPT,), generator=gen).tolist()
            before = read_gb_s_now(probe)
            llm.generate([{"prompt_token_ids": prompt, "prompt": None}], params)
            if r:
                medians[name].append(statistics.median(forwards) / 1e6)
                moments[name].append(max(before, read_gb_s_now(probe)))
    del probe
    model.layer_loop = loop
    stream = weight_stream_ms(model)
    bw = measure_bandwidth(1024, torch.get_num_threads())
    roof = roofline(model_facts(str(pull_default_model())), "bfloat16", PROMPT, OUT, bw.read_gb_s)
    roof_ms = roof.roofline_ms_per_tok
    kv = roof.kv_bytes_per_token * roof.mean_context
    print(f"CPU: {detect_cpu().summary()}; compute path: {core.compute_plan.summary()}")
    print(f"read bandwidth {bw.read_gb_s:.1f} GB/s; weights {roof.weight_bytes / 1e6:.0f} MB + KV {kv / 1e6:.1f} MB "
          f"at the mean context -> roofline {roof_ms:.2f} ms/step")
    print(f"weight stream alone (linears back to back): {stream:.2f} ms")
    print("| loop | forward ms (median of rounds) | rounds | outside the weight stream ms | % of roofline "
          "| each round: % of its own moment's roofline (GB/s) |")
    print("|---|---:|---|---:|---:|---|")
    for name, ms in medians.items():
        m = statistics.median(ms)
        own = " ".join(f"{roof.bytes_per_step / (gb * 1e9) * 1e3 / x:.0%} ({gb:.0f})"
                       for x, gb in zip(ms, moments[name]))
        print(f"| {name} | {m:.2f} | {' '.join(f'{x:.2f}' for x in ms)} | {m - stream:.2f} | {roof_ms / m:.0%} "
              f"| {own} |")
    c, py = statistics.median(medians["C loop"]), statistics.median(medians["Python loop"])
    print(f"C loop / Python loop forward: {py / c:.2f}x faster")


if __name__ == "__main__":
    main()
