"""What serving adds to the engines: the frontend's path to a worker, and how served steps differ from profiled ones.

A step profile (`kvbaton sim profile`) times crafted steps on an engine that has the machine to itself.
A served request also crosses the HTTP frontend and the router (tokenize, admit, route, IPC to the
worker, the first chunk streamed back): a delay before the first token, by prompt size. And a served step
is not a crafted one: the frontend, the benchmark client, a second worker and KV transfers run beside it,
on a CPU host on the very cores it computes on, and its prompt is one the engine has not seen. Measured
on a 2-core Xeon (AMX), served steps with prompt tokens ran 1.0-1.5x their profiled time (more for
longer prompts, and on a prefill worker whose decode peer computes beside it) while decode steps ran
0.9-1.05x, and those ratios held from 0.5 to 3 req/s; so they are measured, per role, from a served
run's step trace (`ServedSteps`), and a simulated step draws its ratio from them.

    served step = profiled seconds x ratio (drawn from its role's measured ratios, by kind and prompt size) + gap_s

Nothing here comes from first principles: `kvbaton sim calibrate` measures the ratios from a step trace
(`kvbaton serve --step-trace`) and the delays from that run's TTFTs (kvbaton.sim.calibrate); validation
then uses other loads.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


# Prompt sizes, bucketed (<= 64, <= 256, <= 1024 tokens, more): served prompt steps slow down with their size
# (measured on a 2-core Xeon: about 1.0x the profile at 64 tokens, 1.1x at 256, 1.15-1.5x at 1024), and so does
# what a request spends outside the engines (about 10 ms at 64 tokens, 15-30 ms at 1024).
PROMPT_BUCKETS = (64, 256, 1024)
BUCKET_NAMES = (*(f"<={n}" for n in PROMPT_BUCKETS), f">{PROMPT_BUCKETS[-1]}")


def prompt_bucket(prompt_tokens: int) -> int:
    return bisect.bisect_left(PROMPT_BUCKETS, prompt_tokens)


@dataclass(frozen=True)
class BySize:
    """Measured values (equal-mass quantiles) per prompt bucket; () for a bucket nothing measured fell in, which
    borrows its nearest measured neighbour's (a tie: the larger prompts', the dearer)."""

    buckets: tuple[tuple[float, ...], ...]

    @classmethod
    def same(cls, *values: float) -> BySize:
        return cls((tuple(values),) * len(BUCKET_NAMES))

    def __post_init__(self) -> None:
        if len(self.buckets) != len(BUCKET_NAMES) or not any(self.buckets):
            raise ConfigError(f"host overhead: give values for {len(BUCKET_NAMES)} prompt sizes (at least one)")

    def values(self) -> tuple[float, ...]:
        return tuple(v for bucket in self.buckets for v in bucket)

    def of(self, prompt_tokens: int) -> tuple[float, ...]:
        want = prompt_bucket(prompt_tokens)
        measured = [i for i, bucket in enumerate(self.buckets) if bucket]
        return self.buckets[min(measured, key=lambda i: (abs(i - want), -i))]

    def describe(self, fmt: Callable[[float], str]) -> str:
        """Each measured bucket's median, as `fmt` writes it."""
        return ", ".join(f"{fmt(_median(b))} ({name})" for name, b in zip(BUCKET_NAMES, self.buckets) if b)

    @classmethod
    def parse(cls, doc: Any) -> BySize:
        """A list per bucket, or one number for every size (a file written by hand)."""
        if isinstance(doc, list):
            return cls(tuple(_floats(b) for b in doc))
        return cls.same(float(doc))


def draw(values: tuple[float, ...], rng: random.Random) -> float:
    return values[0] if len(values) == 1 else rng.choice(values)


@dataclass(frozen=True, kw_only=True)
class ServedSteps:
    """How one role's served steps compare with its step profile (`kvbaton.sim.served_steps` measures it).

    A step the profile prices at `p` seconds takes `p * r + gap_s`; `r` is drawn from the ratios measured for
    steps like it: decode-only steps, or steps with about as many prompt tokens. Drawn, not averaged: served
    steps vary, and queues grow their tails from that variance (a mean ratio put TTFT p99 10-20% low)."""

    prompt_ratios: BySize = BySize.same(1.0)  # served / profiled seconds of steps with prompt tokens
    decode_ratios: tuple[float, ...] = (1.0,)  # of decode-only steps
    gap_s: float = 0.0  # the worker's own loop between two steps while it has work (receive, send outputs)
    num_steps: int = 0  # how many traced steps the figures come from

    def __post_init__(self) -> None:
        if not self.decode_ratios or not all(0.01 <= r <= 100.0 for r in (*self.prompt_ratios.values(),
                                                                             *self.decode_ratios)):
            raise ConfigError("host overhead: served/profiled step ratios must be in [0.01, 100], decode ones too")
        if not 0.0 <= self.gap_s < 1.0 or self.num_steps < 0:
            raise ConfigError("host overhead: the gap between steps must be in [0, 1) s")

    @property
    def is_identity(self) -> bool:
        return ServedSteps() == dataclasses.replace(self, num_steps=0)

    def ratios_for(self, shape: StepShape) -> tuple[float, ...]:
        return self.prompt_ratios.of(shape.prefill_tokens) if shape.prefill_tokens else self.decode_ratios

    def seconds(self, profiled_s: float, shape: StepShape, rng: random.Random, steps: int = 1) -> float:
        """A scheduled step of `steps` model steps of this shape (a decode burst: the gap once, as the engine's
        Python between steps)."""
        return sum(profiled_s * draw(self.ratios_for(shape), rng) for _ in range(steps)) + self.gap_s

    def describe(self) -> str:
        return (f"prompt steps {self.prompt_ratios.describe(lambda r: f'x{r:.2f}')}; decode-only "
                f"x{_median(self.decode_ratios):.2f} (medians); +{self.gap_s * 1e3:.2f} ms between steps")

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_ratios": [list(b) for b in self.prompt_ratios.buckets],
                "decode_ratios": list(self.decode_ratios), "gap_s": self.gap_s, "num_steps": self.num_steps}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ServedSteps:
        return cls(prompt_ratios=BySize.parse(doc["prompt_ratios"]), decode_ratios=_floats(doc["decode_ratios"]),
                   gap_s=float(doc["gap_s"]), num_steps=int(doc.get("num_steps", 0)))


IDENTITY = ServedSteps()


@dataclass(frozen=True, kw_only=True)
class HostOverhead:
    """The served system around the engines: each request's dispatch delay, and each role's served steps.

    A request's delay is drawn (seeded) from `dispatch_s` for its prompt's size: what a calibration run's
    TTFTs took beyond its replay with served steps, what the engines do not explain (the frontend's path,
    its queue while the host is busy). `kvbaton sim calibrate` keeps one value, the median, per size."""

    dispatch_s: BySize = BySize.same(0.0)  # from arrival to the worker's queue, and the first token back
    roles: Mapping[str, ServedSteps] = field(default_factory=dict)  # by role: "both", "prefill", "decode"
    calibrated_on: str = ""  # what run the figures were measured on, for the reader of a report

    def __post_init__(self) -> None:
        if not all(0.0 <= d < 60.0 for d in self.dispatch_s.values()):  # also refuses NaN
            raise ConfigError("host overhead: dispatch delays must be in [0, 60) s")
        unknown = sorted(set(self.roles) - set(ROLES))
        if unknown:
            raise ConfigError(f"host overhead: unknown role {unknown[0]!r} (roles: {', '.join(ROLES)})")

    @property
    def is_zero(self) -> bool:
        return not any(self.dispatch_s.values()) and all(steps.is_identity for steps in self.roles.values())

    def dispatch(self, prompt_tokens: int, rng: random.Random) -> float:
        return draw(self.dispatch_s.of(prompt_tokens), rng)

    def steps_for(self, role: str) -> ServedSteps:
        """`role`'s served steps; a role the calibration did not see takes the colocated worker's ("both"), so a
        colocated calibration can answer a what-if about disaggregation (less exactly)."""
        return self.roles.get(role) or self.roles.get("both") or IDENTITY

    def describe(self) -> str:
        steps = "".join(f"; {role}: {steps.describe()}" for role, steps in self.roles.items())
        return f"dispatch {self.dispatch_s.describe(lambda d: f'{d * 1e3:.1f} ms')} (medians){steps}"

    def to_dict(self) -> dict[str, Any]:
        return {"dispatch_s": [list(b) for b in self.dispatch_s.buckets],
                "roles": {r: s.to_dict() for r, s in self.roles.items()}, "calibrated_on": self.calibrated_on}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HostOverhead:
        """A `kvbaton sim calibrate --out` file (or one written by hand: a number stands for every prompt size); a
        clear ConfigError for anything else."""
        try:
            doc = json.loads(Path(path).read_text())
            return cls(dispatch_s=BySize.parse(doc["dispatch_s"]),
                       roles={str(role): ServedSteps.from_dict(s) for role, s in doc["roles"].items()},
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
