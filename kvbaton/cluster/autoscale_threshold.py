"""The local-prefill threshold, moved at run time from measured interference (`serve --autoscale
--adapt-threshold`, PD deployments). Pure: measurements in, a threshold out (no I/O, no clock).

In PD, prompts shorter than the threshold prefill on their decode worker: no transfer, no prefill-pool
queue, but their chunks share steps with the worker's decoding sequences, whose TPOT they stretch. The
decode workers time their steps: those that only decode, and the mixed ones that also computed prompt
tokens. What the mixed steps took beyond a decode-only step is the interference; over the decode
workers' step time, its share.

    lower (halve, to --min-local-prefill-threshold)   the share is at least `interference_high`, TPOT p99 is
                                                       near its SLO (above down_fill of it), and the prefill
                                                       pool is not itself missing TTFT with prompts waiting
    raise (double, to --max-local-prefill-threshold) the prefill pool misses TTFT with prompts waiting and
                                                       cannot grow (its maximum, or --max-workers), while
                                                       TPOT p99 is calm (at most down_fill of its SLO) and
                                                       the share is under `interference_high`
    otherwise hold; after a change, hold for the cooldown (the next interval must show its effect)

The two conditions exclude each other (TPOT near vs calm), so the threshold cannot flap within a cooldown.
Adding prefill workers is the pool autoscaler's answer to a slow prefill pool; raising the threshold is
the answer left once it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.cluster.autoscale_policy import AutoscaleConfig, Measurements


@dataclass(frozen=True, kw_only=True)
class ThresholdDecision:
    current: int
    target: int
    reason: str
    held_by: str = ""  # a hold despite a wanted change: "cooldown", or a bound ("min_threshold", "max_threshold")

    @property
    def changed(self) -> bool:
        return self.target != self.current

    def describe(self) -> str:
        if not self.changed:
            return f"autoscaler: hold local-prefill threshold at {self.current} tokens: {self.reason}"
        verb = "lower" if self.target < self.current else "raise"
        return f"autoscaler: {verb} local-prefill threshold {self.current}->{self.target} tokens: {self.reason}"


def threshold_decision(c: AutoscaleConfig, m: Measurements, current: int, prefill_can_grow: bool,
                       seconds_since_change: float | None) -> ThresholdDecision:
    """The local-prefill threshold wanted now, and why."""
    steps, share = m.decode_steps, (m.decode_steps.prefill_share if m.decode_steps is not None else None)
    if steps is None or share is None:
        return ThresholdDecision(current=current, target=current, reason="no decode-only step measured yet")
    facts = [f"local prefills took {share:.0%} of decode-step time (mixed steps "
             f"{_mean_ms(steps.mixed_s, steps.mixed_steps)} vs decode-only "
             f"{_mean_ms(steps.decode_only_s, steps.decode_only_steps)}, {steps.mixed_steps} of "
             f"{steps.mixed_steps + steps.decode_only_steps})",
             f"TPOT p99 {_ms(m.tpot_p99_s)} (SLO {c.slo_tpot_s * 1000:.0f} ms)",
             f"TTFT p99 {_ms(m.ttft_p99_s)} (SLO {c.slo_ttft_s * 1000:.0f} ms)"]
    waiting = m.prefill.waiting_mean if m.prefill is not None else 0.0
    prefill_pressed = m.ttft_p99_s is not None and m.ttft_p99_s > c.slo_ttft_s and waiting > 0
    facts.append(f"{waiting:.1f} prompts waiting for a prefill worker"
                 + ("" if prefill_can_grow else " (the prefill pool cannot grow)"))
    tpot_near = m.tpot_p99_s is not None and m.tpot_p99_s > c.slo_tpot_s * c.down_fill
    if share >= c.interference_high and tpot_near and not prefill_pressed:
        target, bound = min(current, max(c.min_threshold, current // 2)), "min_threshold"
    elif prefill_pressed and not prefill_can_grow and not tpot_near and share < c.interference_high:
        target, bound = max(current, min(c.max_threshold, max(current * 2, c.min_threshold, 1))), "max_threshold"
    else:
        return ThresholdDecision(current=current, target=current, reason="; ".join(facts))
    reason = "; ".join(facts)
    if target == current:
        return ThresholdDecision(current=current, target=current, held_by=bound,
                                 reason=f"at --{bound.replace('_', '-local-prefill-', 1)}; {reason}")
    if seconds_since_change is not None and seconds_since_change < c.cooldown_s:
        return ThresholdDecision(current=current, target=current, held_by="cooldown",
                                 reason=f"wanted {target}, cooling down ({c.cooldown_s - seconds_since_change:.0f} s "
                                        f"left); {reason}")
    return ThresholdDecision(current=current, target=target, reason=reason)


def _mean_ms(seconds: float, steps: int) -> str:
    return f"{seconds / steps * 1000:.1f} ms" if steps else "n/a"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"
