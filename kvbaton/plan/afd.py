"""`kvbaton plan --afd-profile FILE`: the attention:expert split and micro-batch count for attention/FFN
disaggregation, from what each side's work costs (`sim/afd.py`'s timeline).

The profile is an `AfdCosts` as JSON: per layer and micro-batch, the attention side's compute and its post +
combine, the expert side's work, the wire's one-way latency, each affine in the micro-batch's tokens.
`benchmarks/bench_afd.py` fits one on the machine it runs on from its m = 1 steps and stores it in its result
JSON (`afd_profile`), which this reads as it is. For every split of `--afd-workers` workers into attention and
expert workers it picks the best m and predicts the step, both sides' bubble and the deployment's decode
throughput, each attention worker decoding `--afd-batch` sequences. First-order: the attention workers step in
lockstep and spread their rows evenly (`with_ratio`), the two sides do not slow each other down."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvbaton.config import ConfigError
from kvbaton.sim.afd import AfdCosts, AfdPlan, plan_afd


def load_profile(path: str | Path) -> AfdCosts:
    """An AFD cost profile: a bare `AfdCosts.to_dict()` JSON or a bench_afd result holding one."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--afd-profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--afd-profile {path}: not JSON ({exc})") from None
    if isinstance(doc, dict) and "afd_profile" in doc:
        doc = doc["afd_profile"]
    if doc is None:
        raise ConfigError(f"--afd-profile {path}: the run has no profile (it measured no m = 1 step)")
    return AfdCosts.from_dict(doc)


@dataclass(frozen=True)
class AfdReport:
    workers: int
    tokens: int
    plans: list[AfdPlan]  # every split, fastest first
    per_m: dict[int, AfdPlan]  # the fastest split at each m

    def to_json(self) -> dict[str, Any]:
        def row(p: AfdPlan) -> dict[str, Any]:
            return {"attention_workers": p.attention_workers, "expert_workers": p.expert_workers,
                    "micro_batches": p.micro_batches, "step_ms": p.step.seconds * 1e3,
                    "tokens_per_s": p.tokens_per_s, "attention_bubble": p.step.attention_bubble,
                    "expert_bubble": p.step.expert_bubble}
        return {"workers": self.workers, "tokens_per_attention_worker": self.tokens,
                "plans": [row(p) for p in self.plans], "per_micro_batches": {m: row(p) for m, p in self.per_m.items()}}


def plan(costs: AfdCosts, workers: int, tokens: int, candidates: tuple[int, ...]) -> AfdReport:
    if workers < 2:
        raise ConfigError("--afd-workers: an AFD deployment needs at least 2 workers (an attention and an expert one)")
    if tokens < 1 or not candidates or min(candidates) < 1:
        raise ConfigError("--afd-batch and --afd-micro-batches must be at least 1")
    per_m = {m: plan_afd(costs, tokens, workers, (m,))[0] for m in candidates}
    return AfdReport(workers, tokens, plan_afd(costs, tokens, workers, candidates), per_m)


def print_report(console: Console, report: AfdReport) -> None:
    best = report.plans[0]
    console.print(f"Attention/FFN disaggregation over {report.workers} workers, {report.tokens} sequences per "
                  f"attention worker: best {best.attention_workers}:{best.expert_workers} (attention:expert) at "
                  f"m = {best.micro_batches}, {best.tokens_per_s:,.0f} tokens/s predicted")
    table = Table(title="every split, at its best m")
    for col in ("attention:expert", "m", "step ms", "tokens/s", "attention bubble", "expert bubble"):
        table.add_column(col, justify="right")
    for p in report.plans:
        table.add_row(f"{p.attention_workers}:{p.expert_workers}", str(p.micro_batches), f"{p.step.seconds * 1e3:.2f}",
                      f"{p.tokens_per_s:,.0f}", f"{p.step.attention_bubble:.2f}", f"{p.step.expert_bubble:.2f}")
    console.print(table)
    by_m = Table(title="the best split at each m")
    for col in ("m", "attention:expert", "step ms", "tokens/s", "attention bubble", "expert bubble"):
        by_m.add_column(col, justify="right")
    for m, p in report.per_m.items():
        by_m.add_row(str(m), f"{p.attention_workers}:{p.expert_workers}", f"{p.step.seconds * 1e3:.2f}",
                     f"{p.tokens_per_s:,.0f}", f"{p.step.attention_bubble:.2f}", f"{p.step.expert_bubble:.2f}")
    console.print(by_m)
