"""What serving adds to the engines: the frontend's path to a worker, and how served steps differ from profiled ones.

A step profile (`kvbaton sim profile`) times crafted steps on an engine that has the machine to itself.
A served request also crosses the HTTP frontend and the router (tokenize, admit, route, IPC to the
worker, the first chunk streamed back): a fixed `dispatch_s` before the first token. And a served step
is not a crafted one: the frontend, the benchmark client, a second worker and KV transfers run beside it,
on a CPU host on the very cores it computes on, and its prompt is one the engine has not seen. Measured
on a 2-core Xeon (AMX), served steps with prompt tokens ran 1.0-1.5x their profiled time (more for
longer prompts, and on a prefill worker whose decode peer computes beside it) while decode steps ran
0.9-1.05x, and those ratios held from 0.5 to 3 req/s; so they are measured, per role, from a served
run's step trace (`ServedSteps`), and a simulated step draws its ratio from them.

    served step = profiled seconds x ratio (drawn from the role's measured ratios of its kind) + gap_s

Nothing here comes from first principles: `kvbaton sim calibrate` measures the ratios from a step trace
(`kvbaton serve --step-trace`) and fits `dispatch_s` to that run's TTFT median (kvbaton.sim.calibrate);
validation then uses other loads.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbaton.config import ConfigError
from kvbaton.sim.latency import StepShape

ROLES = ("both", "prefill", "decode")  # a trace's roles (kvbaton.engine.core.trace_role)
MAX_RATIOS = 64  # quantiles kept of each kind's measured ratios: the distribution's shape, not every step


def quantiles(values: Sequence[float], n: int = MAX_RATIOS) -> tuple[float, ...]:
    """`values` sorted, thinned to `n` equal-mass quantiles (all of them when there are fewer)."""
    ordered = sorted(values)
    if len(ordered) <= n:
        return tuple(ordered)
    return tuple(ordered[int((i + 0.5) * len(ordered) / n)] for i in range(n))


# A step's prompt tokens, bucketed (<= 64, <= 256, <= 1024, more): served prompt steps slow down with their size
# (measured on a 2-core Xeon: about 1.0x the profile at 64 tokens, 1.2x at 256, 1.3x at 1024).
PROMPT_BUCKETS = (64, 256, 1024)


def prompt_bucket(prompt_tokens: int) -> int:
    return bisect.bisect_left(PROMPT_BUCKETS, prompt_tokens)


@dataclass(frozen=True, kw_only=True)
class ServedSteps:
    """How one role's served steps compare with its step profile (`kvbaton.sim.served_steps` measures it).

    A step the profile prices at `p` seconds takes `p * r + gap_s`; `r` is drawn from the ratios measured for
    steps like it: decode-only steps, or steps with about as many prompt tokens (`PROMPT_BUCKETS`; a bucket
    no traced step fell in borrows its nearest one's). Drawn, not averaged: served steps vary, and queues grow
    their tails from that variance (a mean ratio put TTFT p99 10-20% low)."""

    # served / profiled seconds, equal-mass quantiles: per prompt bucket (() where none was traced), decode-only
    prompt_ratios: tuple[tuple[float, ...], ...] = ((1.0,),) * (len(PROMPT_BUCKETS) + 1)
    decode_ratios: tuple[float, ...] = (1.0,)
    gap_s: float = 0.0  # the worker's own loop between two steps while it has work (receive, send outputs)
    num_steps: int = 0  # how many traced steps the figures come from

    def __post_init__(self) -> None:
        ratios = (*(r for bucket in self.prompt_ratios for r in bucket), *self.decode_ratios)
        if len(self.prompt_ratios) != len(PROMPT_BUCKETS) + 1 or not any(self.prompt_ratios) \
                or not self.decode_ratios or not all(0.01 <= r <= 100.0 for r in ratios):
            raise ConfigError(f"host overhead: served/profiled step ratios must be in [0.01, 100], for decode steps "
                              f"and for {len(PROMPT_BUCKETS) + 1} prompt sizes (at least one measured)")
        if not 0.0 <= self.gap_s < 1.0 or self.num_steps < 0:
            raise ConfigError("host overhead: the gap between steps must be in [0, 1) s")

    @property
    def is_identity(self) -> bool:
        return ServedSteps() == dataclasses.replace(self, num_steps=0)

    def ratios_for(self, shape: StepShape) -> tuple[float, ...]:
        if not shape.prefill_tokens:
            return self.decode_ratios
        want = prompt_bucket(shape.prefill_tokens)
        measured = [i for i, bucket in enumerate(self.prompt_ratios) if bucket]
        return self.prompt_ratios[min(measured, key=lambda i: (abs(i - want), -i))]  # a tie: the larger prompts'

    def seconds(self, profiled_s: float, shape: StepShape, rng: random.Random) -> float:
        ratios = self.ratios_for(shape)
        ratio = ratios[0] if len(ratios) == 1 else rng.choice(ratios)
        return profiled_s * ratio + self.gap_s

    def describe(self) -> str:
        edges = [f"<={n}" for n in PROMPT_BUCKETS] + [f">{PROMPT_BUCKETS[-1]}"]
        prompt = ", ".join(f"x{_median(r):.2f} ({edge})" for edge, r in zip(edges, self.prompt_ratios) if r)
        return (f"prompt steps {prompt}; decode-only x{_median(self.decode_ratios):.2f} (medians); "
                f"+{self.gap_s * 1e3:.2f} ms between steps")


IDENTITY = ServedSteps()


@dataclass(frozen=True, kw_only=True)
class HostOverhead:
    """The served system around the engines: a dispatch delay, and each role's served steps."""

    dispatch_s: float = 0.0  # from a request's arrival to its worker's queue (and the first chunk back)
    roles: Mapping[str, ServedSteps] = field(default_factory=dict)  # by role: "both", "prefill", "decode"
    calibrated_on: str = ""  # what run the figures were measured on, for the reader of a report

    def __post_init__(self) -> None:
        if not 0.0 <= self.dispatch_s < 60.0:  # also refuses NaN
            raise ConfigError("host overhead: dispatch must be in [0, 60) s")
        unknown = sorted(set(self.roles) - set(ROLES))
        if unknown:
            raise ConfigError(f"host overhead: unknown role {unknown[0]!r} (roles: {', '.join(ROLES)})")

    @property
    def is_zero(self) -> bool:
        return self.dispatch_s == 0.0 and all(steps.is_identity for steps in self.roles.values())

    def steps_for(self, role: str) -> ServedSteps:
        """`role`'s served steps; a role the calibration did not see takes the colocated worker's ("both"), so a
        colocated calibration can answer a what-if about disaggregation (less exactly)."""
        return self.roles.get(role) or self.roles.get("both") or IDENTITY

    def describe(self) -> str:
        steps = "; ".join(f"{role}: {steps.describe()}" for role, steps in self.roles.items())
        return f"dispatch {self.dispatch_s * 1e3:.1f} ms" + (f"; {steps}" if steps else "")

    def to_dict(self) -> dict[str, Any]:
        return {"dispatch_s": self.dispatch_s, "roles": {r: asdict(s) for r, s in self.roles.items()},
                "calibrated_on": self.calibrated_on}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HostOverhead:
        """A `kvbaton sim calibrate --out` file; a clear ConfigError for anything else."""
        try:
            doc = json.loads(Path(path).read_text())
            roles = {str(role): ServedSteps(prompt_ratios=tuple(_floats(b) for b in s["prompt_ratios"]),
                                            decode_ratios=_floats(s["decode_ratios"]), gap_s=float(s["gap_s"]),
                                            num_steps=int(s.get("num_steps", 0)))
                     for role, s in doc["roles"].items()}
            return cls(dispatch_s=float(doc["dispatch_s"]), roles=roles,
                       calibrated_on=str(doc.get("calibrated_on", "")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path}: not a host-overhead file from `kvbaton sim calibrate` ({exc})") from exc


def _floats(values: Any) -> tuple[float, ...]:
    if not isinstance(values, list):
        raise TypeError("ratios must be lists")
    floats = tuple(float(v) for v in values)
    if not all(math.isfinite(v) for v in floats):
        raise ValueError("ratios must be finite")
    return floats


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
