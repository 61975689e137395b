"""How a plan and a diagnosis are shown: rich tables on the terminal, and one JSON document."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvbaton.plan.actions import Action
from kvbaton.plan.candidate import Candidate
from kvbaton.plan.diagnose import Diagnosis, explain
from kvbaton.plan.evaluate import Evaluation, Harness
from kvbaton.plan.search import PlanResult

GB = 1e9
MIB = 2**20


def print_header(harness: Harness, console: Console) -> None:
    s, load = harness.setting, harness.load
    m = s.model
    moe = f", MoE {m.moe.num_experts} experts top-{m.moe.top_k}" if m.moe else ""
    mla = ", MLA" if m.mla else ""
    console.print(f"[bold]kvbaton plan[/bold]: {m.name} ({m.total_params / 1e9:.1f} B params, "
                  f"{m.active_params / 1e9:.1f} B active{moe}{mla}) on {s.hardware.description}")
    console.print(f"load: {load.qps:g} QPS, {load.mean_prompt_len} prompt / {load.output_len} output tokens"
                  f"{f' (range ratio {load.range_ratio:g})' if load.range_ratio else ''}; SLO per request: TTFT <= "
                  f"{load.slo_ttft_ms:g} ms and TPOT <= {load.slo_tpot_ms:g} ms, met by >= "
                  f"{load.attainment_target:.0%} of requests (DistServe's attainment); simulated windows of "
                  f"{harness.options.window_s:g} s, seed {harness.options.seed}")
    hw = s.hardware
    console.print(f"roofline: {hw.bf16_flops / 1e12:.0f} TFLOP/s bf16 x MFU {hw.compute_efficiency:g}, "
                  f"{hw.memory_bandwidth / 1e12:.2f} TB/s x {hw.bandwidth_efficiency:g}, intra-node link "
                  f"{hw.link_bandwidth / GB:.0f} GB/s per direction x {hw.link_efficiency:g}, step overhead "
                  f"{hw.step_overhead_s * 1e3:g} ms; PP stages without micro-batch overlap")


def memory_table(candidates: Sequence[Candidate], seq_len: int) -> Table:
    table = Table(title=f"memory per GPU (sequences of {seq_len} tokens)")
    for col in ("configuration", "weights GB", "reserve GB", "KV pool GB", "KV/token/GPU", "KV tokens/inst",
                "max seqs/inst"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    seen = set()
    for c in candidates:
        key = (c.deployment.parallel, c.deployment.kv_dtype)
        if key in seen:
            continue
        seen.add(key)
        m = c.memory
        table.add_row(c.deployment.parallel.label + f" kv {c.deployment.kv_dtype.value}", f"{m.weight_bytes / GB:.1f}",
                      f"{m.reserve_bytes / GB:.1f}", f"{max(m.kv_pool_bytes, 0) / GB:.1f}",
                      f"{m.kv_bytes_per_token_per_device / 1024:.1f} KiB", f"{m.kv_tokens:,}",
                      str(m.max_seqs(seq_len)) if m.fits(seq_len) else "does not fit")
    return table


def results_table(candidates: Sequence[Candidate], qps: float, budget: int | None) -> Table:
    table = Table(title="goodput per configuration (DistServe: highest rate meeting the attainment target)")
    cols = ["configuration", "GPUs/unit", "goodput/unit", "goodput/GPU", f"GPUs for {qps:g} QPS",
            "TPOT p99", "TTFT p99", "KV peak"]
    if budget is not None:
        cols.append(f"on {budget} GPUs: attainment / TPOT p99")
    for col in cols:
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for c in candidates:
        if not c.fits:
            table.add_row(c.deployment.label, str(c.deployment.unit_devices), "does not fit", *[""] * (len(cols) - 3))
            continue
        best = c.goodput.best if c.goodput else None
        row = [c.deployment.label, str(c.deployment.unit_devices), f"{c.goodput.rate if c.goodput else 0:.2f}",
               f"{c.per_device:.3f}", str(c.devices_for(qps) or "none"), *_latencies(best)]
        if budget is not None:
            row.append(_at_target(c.at_target))
        table.add_row(*row)
    return table


def _latencies(ev: Evaluation | None) -> list[str]:
    if ev is None:
        return ["-", "-", "-"]
    return [f"{ev.tpot_p99_ms:.0f} ms", _ms(ev.ttft_p99_ms), f"{ev.peak_kv_usage:.0%}"]


def _at_target(ev: Evaluation | None) -> str:
    return "-" if ev is None else f"{ev.attainment:.0%} / {ev.tpot_p99_ms:.0f} ms"


def _ms(ms: float) -> str:
    return "n/a" if math.isinf(ms) else (f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s")


def print_plan(result: PlanResult, console: Console) -> None:
    load = result.harness.load
    console.print(memory_table(result.candidates, load.mean_seq_len))
    console.print(results_table(result.candidates, load.qps, result.device_budget))
    rec = result.recommended
    if rec is None:
        console.print(f"[bold red]no configuration met {load.attainment_target:.0%} attainment at any rate tried"
                      "[/bold red]: loosen the SLOs or try other hardware")
    else:
        devices = rec.devices_for(load.qps)
        console.print(f"[bold]recommended[/bold]: {rec.deployment.label} (units of {rec.deployment.unit_devices} "
                      f"GPUs), {rec.per_device:.3f} req/s per GPU; {load.qps:g} QPS needs {devices} GPUs")
    if result.disaggregation is not None:
        d = result.disaggregation
        extra = f", prefill locally below {d.local_prefill_threshold} uncached tokens (serve --local-prefill-" \
            f"threshold {d.local_prefill_threshold}; --autoscale --adapt-threshold moves it with the measured " \
            "interference)" if d.local_prefill_threshold else ""
        console.print(f"[bold]disaggregation[/bold]: {d.mode.value}{extra} ({d.reason})")


def print_diagnosis(d: Diagnosis, actions: Sequence[Action], harness: Harness, console: Console) -> None:
    m, dep, load = d.memory, d.current.deployment, harness.load
    console.print(f"[bold]diagnosis of {dep.label}[/bold] ({d.num_instances} instances of "
                  f"{dep.unit_devices} GPUs = {d.devices} GPUs)")
    per_request = m.kv_bytes_per_token * d.tokens_per_request
    console.print(f"KV per token: {d.kv_formula}")
    console.print(f"KV per request: x {d.tokens_per_request:,} tokens ({load.mean_prompt_len} + {load.output_len}) "
                  f"= {per_request / MIB:,.1f} MiB")
    console.print(f"weights: {d.weight_bytes_total / GB:.1f} GB / {dep.parallel.num_devices} GPUs = "
                  f"{m.weight_bytes / GB:.1f} GB per GPU")
    console.print(f"KV pool: {m.device_bytes / GB:.1f} GB x {dep.gpu_memory_utilization:g} - "
                  f"{m.weight_bytes / GB:.1f} GB weights - {m.reserve_bytes / GB:.1f} GB runtime and activations = "
                  f"{m.kv_pool_bytes / GB:.1f} GB per GPU, {m.kv_pool_bytes_per_instance / GB:.0f} GB per instance "
                  f"= {m.kv_tokens:,} tokens = {d.max_seqs_kv} sequences of {d.tokens_per_request} tokens")
    for i, finding in enumerate(explain(d), 1):
        console.print(f"{i}. {finding}")
    console.print(actions_table(d, actions, load.qps, load.attainment_target))
    console.print(f"  TPOT, TTFT, goodput and attainment: simulated at the target {load.qps:g} QPS. goodput/GPU: at "
                  f"the highest rate per unit at which {load.attainment_target:.0%} of requests meet the SLOs, "
                  "however far below the target that rate is.")
    for rank, a in enumerate(actions, 1):
        for n in a.notes:
            console.print(f"  ({rank}) {n}")
    best = actions[0].result
    console.print(f"[bold]best action[/bold]: {actions[0].change}: {best.per_device:.3f} req/s per GPU; "
                  f"{load.qps:g} QPS at the SLOs then needs {best.devices_for(load.qps) or 'more than any'} GPUs "
                  f"(today: {d.current.devices_for(load.qps) or 'no rate met the target'}; available: {d.devices}).")
    served_now = d.current.goodput.rate * d.num_instances if d.current.goodput else 0.0
    served_best = best.goodput.rate * best.units_on(d.devices) if best.goodput else 0.0
    verdict = "meets" if served_best >= load.qps else "cannot meet"
    console.print(f"on the {d.devices} GPUs: {served_now:.0f} QPS at the SLOs today, {served_best:.0f} QPS after the "
                  f"best action, which {verdict} the {load.qps:g} QPS target.")


def actions_table(d: Diagnosis, actions: Sequence[Action], qps: float, attainment_target: float) -> Table:
    table = Table(title=f"ranked actions, simulated at {qps:g} QPS on {d.devices} GPUs (before -> after)")
    for col in ("rank", "action", "change", "TPOT p99", "TTFT p99", "goodput req/s", "attainment",
                f"goodput/GPU where {attainment_target:.0%} meet SLO"):
        table.add_column(col, justify="right" if col in ("rank",) else "left")
    b = d.before
    for rank, a in enumerate(actions, 1):
        after = a.result.at_target
        units = a.result.units_on(d.devices)
        table.add_row(str(rank), a.kind.value, a.change, f"{b.tpot_p99_ms:.0f} -> {_v(after, 'tpot_p99_ms', '.0f')} ms",
                      f"{_ms(b.ttft_p99_ms)} -> {_ms(after.ttft_p99_ms) if after else '-'}",
                      f"{b.goodput * d.num_instances:.1f} -> "
                      f"{after.goodput * units if after else 0:.1f}",
                      f"{b.attainment:.0%} -> {_v(after, 'attainment', '.0%')}",
                      f"{d.current.per_device:.3f} -> {a.result.per_device:.3f}")
    return table


def _v(ev: Evaluation | None, name: str, fmt: str) -> str:
    return "-" if ev is None else format(getattr(ev, name), fmt)


def jsonable(obj: object) -> object:
    """Dataclasses, enums and tuples as plain JSON values (inf as null)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.name not in ("pool",)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)  # e.g. a latency model's parameters


def write_json(path: str | Path, document: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(jsonable(document), indent=2) + "\n")
