"""Attention/FFN disaggregation's decode step, as a timeline of two servers: what a step of B decoding sequences
costs in m micro-batches, given what each side's work costs, and how idle each side stands (the bubble).

The attention side runs the micro-batches' layers round-robin in a fixed order (micro-batch 0 of layer l, then
1, ..., then micro-batch 0 of layer l + 1), as `models/ping_pong.py` does; before it can attend a micro-batch's
next layer it waits for that micro-batch's experts. The expert side serves exchanges in arrival order. An
exchange costs the attention side its post and combine, the wire a one-way latency each way, and the expert
side its computation plus its own handling:

    attention  │ a(b0) │ a(b1) │··wait··│ a(b0) │ a(b1) │ ...
    experts    │       │ e(b0)  │ e(b1) │       │ e(b0) │ ...

Each cost is affine in the micro-batch's tokens (`Affine`), fitted to measurements (`benchmarks/bench_afd.py`
fits them on the machine it runs on and checks the predictions against the steps it measured). Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbaton.config import ConfigError


@dataclass(frozen=True)
class Affine:
    """seconds = fixed_s + per_token_s x tokens."""

    fixed_s: float
    per_token_s: float = 0.0

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> Affine:
        """Least squares over (tokens, seconds) points, clamped to non-negative prices."""
        if not points:
            raise ValueError("no points to fit")
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var > 0 else 0.0
        return cls(max(0.0, my - slope * mx), slope)


@dataclass(frozen=True, kw_only=True)
class AfdCosts:
    """What one layer of one micro-batch of `tokens` decoding sequences costs each side (seconds)."""

    attention: Affine  # attention-side compute of one layer (norms, attention, gate, shared experts)
    post: Affine  # attention-side work of one exchange: dispatching the rows and combining the outputs
    experts: Affine  # expert-side work of one exchange: its rows through their experts, and its handling
    latency_s: float  # one way on the wire, neither side busy
    layers: int  # decoder layers
    moe_layers: int  # of which MoE (the others' FFN runs on the attention side, in `attention`)
    # attention-side work once per step, whatever m: scheduling, embedding, the head, sampling
    step: Affine = Affine(0.0)
    # the expert side's weight reads: per distinct expert a micro-batch's tokens hit (decode is bound by them:
    # 4 tokens x top-8 of 64 experts hit ~27, 64 tokens all 64), routing taken as uniform
    per_expert_s: float = 0.0
    num_experts: int = 0
    top_k: int = 0

    def experts_hit(self, tokens: int) -> float:
        """Expected distinct experts `tokens` tokens route to (each picks top_k of num_experts, uniformly)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def expert_work(self, tokens: int) -> float:
        """The expert side's busy time for one exchange of `tokens` tokens' rows."""
        return self.experts(tokens) + self.per_expert_s * self.experts_hit(tokens)

    def to_dict(self) -> dict[str, Any]:
        """The JSON profile `kvbaton plan --afd-profile` reads (`benchmarks/bench_afd.py` writes one)."""
        return {"attention": vars(self.attention), "post": vars(self.post), "experts": vars(self.experts),
                "step": vars(self.step), "latency_s": self.latency_s, "layers": self.layers,
                "moe_layers": self.moe_layers, "per_expert_s": self.per_expert_s, "num_experts": self.num_experts,
                "top_k": self.top_k}

    @classmethod
    def from_dict(cls, d: Any) -> AfdCosts:
        """A profile from `to_dict`'s JSON; ConfigError naming what is missing or out of range."""
        try:
            sides = {side: Affine(float(d[side]["fixed_s"]), float(d[side].get("per_token_s", 0.0)))
                     for side in ("attention", "post", "experts")}
            step = d.get("step", {"fixed_s": 0.0})  # older profiles priced no per-step work
            sides["step"] = Affine(float(step["fixed_s"]), float(step.get("per_token_s", 0.0)))
            costs = cls(**sides, latency_s=float(d["latency_s"]), layers=int(d["layers"]),
                        moe_layers=int(d["moe_layers"]), per_expert_s=float(d.get("per_expert_s", 0.0)),
                        num_experts=int(d.get("num_experts", 0)), top_k=int(d.get("top_k", 0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"an AFD profile needs attention/post/experts {{fixed_s, per_token_s}}, latency_s, "
                              f"layers and moe_layers: {type(exc).__name__} {exc}") from None
        prices = [costs.latency_s, costs.per_expert_s] + [x for a in sides.values() for x in (a.fixed_s, a.per_token_s)]
        if not all(math.isfinite(x) and x >= 0 for x in prices) or not 0 < costs.moe_layers <= costs.layers:
            raise ConfigError("an AFD profile's prices must be finite and >= 0, with 0 < moe_layers <= layers")
        if costs.per_expert_s and not 0 < costs.top_k <= costs.num_experts:
            raise ConfigError("an AFD profile pricing experts hit needs 0 < top_k <= num_experts")
        return costs


@dataclass(frozen=True)
class AfdStep:
    seconds: float
    attention_busy_s: float
    expert_busy_s: float

    @property
    def attention_bubble(self) -> float:
        return max(0.0, 1.0 - self.attention_busy_s / self.seconds) if self.seconds > 0 else 0.0

    @property
    def expert_bubble(self) -> float:
        return max(0.0, 1.0 - self.expert_busy_s / self.seconds) if self.seconds > 0 else 0.0


def split_tokens(tokens: int, micro_batches: int) -> list[int]:
    """As `models/ping_pong.py:splits`: min(tokens, m) micro-batches whose sizes differ by at most one."""
    count = max(1, min(tokens, micro_batches))
    base, extra = divmod(tokens, count)
    return [base + (i < extra) for i in range(count)]


def afd_step(costs: AfdCosts, tokens: int, micro_batches: int) -> AfdStep:
    """One decode step of `tokens` sequences in `micro_batches` micro-batches, on one attention worker and an
    expert pool that serves it alone (an expert worker shared by R attention workers: `expert_share`)."""
    sizes = split_tokens(tokens, micro_batches)
    moe = _moe_layers(costs)
    attention_free = attention_busy = costs.step(tokens)  # the step's own work, before its layers
    expert_free = expert_busy = 0.0
    ready = [0.0] * len(sizes)  # when each micro-batch may go on with its next layer
    for layer in range(costs.layers):
        for j, size in enumerate(sizes):
            start = max(attention_free, ready[j])
            work = costs.attention(size) + (costs.post(size) if layer in moe else 0.0)
            attention_free = start + work
            attention_busy += work
            if layer not in moe:
                ready[j] = attention_free
                continue
            expert_start = max(expert_free, attention_free + costs.latency_s)
            work = costs.expert_work(size)
            expert_free = expert_start + work
            expert_busy += work
            ready[j] = expert_free + costs.latency_s
    return AfdStep(max(max(ready), attention_free), attention_busy, expert_busy)


def best_micro_batches(costs: AfdCosts, tokens: int, candidates: Sequence[int] = (1, 2, 3, 4)) -> int:
    """The count whose step is shortest (the smallest among equals)."""
    return min(candidates, key=lambda m: (afd_step(costs, tokens, m).seconds, m))


def with_ratio(costs: AfdCosts, attention_workers: int, expert_workers: int) -> AfdCosts:
    """The costs one attention worker sees when `attention_workers` of them, in step with each other, share a pool
    of `expert_workers` (each holding 1/E of the experts): an expert worker computes 1/E of every attention
    worker's rows and handles every attention worker's frame, so its work per exchange scales by N/E (per token)
    and N (fixed). A first-order view (steps in lockstep, the rows spread evenly), not a queueing model."""
    if attention_workers < 1 or expert_workers < 1:
        raise ValueError("need at least one attention and one expert worker")
    e = costs.experts
    # NOTE: each attention worker's exchange reads the weights of the experts it hits on the workers holding them
    return dataclasses.replace(costs, experts=Affine(e.fixed_s * attention_workers,
                                                     e.per_token_s * attention_workers / expert_workers),
                               per_expert_s=costs.per_expert_s * attention_workers / expert_workers)


@dataclass(frozen=True)
class AfdPlan:
    attention_workers: int
    expert_workers: int
    micro_batches: int
    step: AfdStep
    tokens_per_s: float  # the deployment's decode throughput


def plan_afd(costs: AfdCosts, tokens: int, workers: int, candidates: Sequence[int] = (1, 2, 3, 4)) -> list[AfdPlan]:
    """Every split of `workers` into attention and expert workers, each at its best m, fastest first; each
    attention worker decodes `tokens` sequences (`costs` measured with one of each)."""
    plans = []
    for n in range(1, workers):
        shared = with_ratio(costs, n, workers - n)
        m = best_micro_batches(shared, tokens, candidates)
        step = afd_step(shared, tokens, m)
        plans.append(AfdPlan(n, workers - n, m, step, n * tokens / step.seconds))
    return sorted(plans, key=lambda p: -p.tokens_per_s)


def _moe_layers(costs: AfdCosts) -> set[int]:
    """Which layers are MoE: the last `moe_layers` (DeepSeek-style dense layers come first)."""
    if not 0 <= costs.moe_layers <= costs.layers:
        raise ValueError(f"{costs.moe_layers} MoE layers of {costs.layers}")
    return set(range(costs.layers - costs.moe_layers, costs.layers))
