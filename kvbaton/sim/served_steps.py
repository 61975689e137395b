"""A step profile fitted to served steps (`--step-trace`), and how served steps compare with a profile.

    kvbaton serve --step-trace traces/ ...            each worker appends its steps
    kvbaton sim fit-steps traces/ --out served.json [--compare sim-profile.json]

`kvbaton sim profile` times crafted steps on an engine that has the machine to itself. A served engine
shares it: with the HTTP frontend, the tokenizer and detokenizer, the other workers, KV transfers. The
profile fitted here prices steps as they ran there, so a simulation with it (`sim run --profile`) carries
that interference for loads like the traced one; `--compare` says how far the crafted profile is from
the served steps, per kind of step (decode, prefill, mixed), which is how much of a gap between a
simulation and a measurement the engine's steps explain (the rest is outside them: queueing in the
frontend, streaming).

Steps of one shape are condensed to their median (a served trace repeats decode shapes thousands of
times); at most `MAX_SAMPLES` shapes are fitted, a fixed-seed draw of them beyond that.

`served_steps` is what `kvbaton sim calibrate` takes from a trace: per role, each served step's seconds over
what a profile predicts for its shape, and the worker's pause between steps while it has work.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbaton.sched.step_shape import StepShape
from kvbaton.sched.step_trace import PROFILE_FORMAT, TRACE_FORMAT
from kvbaton.sim.host import BUCKET_NAMES, BySize, ServedSteps, prompt_bucket, quantiles
from kvbaton.sim.latency import StepLatencyModel
from kvbaton.sim.profiled import ProfiledLatency, ProfileError, ProfileSample

MAX_SAMPLES = 1500  # the fit tries ~100 forms x 5 folds: seconds at this size
# What must agree across the files fitted together: one engine configuration's steps.
SAME_ENGINE = ("model", "dtype", "kv_cache_dtype", "threads", "kernels", "compute_path")
SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(StepShape))
# A longer pause between two steps is the worker waiting for work, not its loop's own cost.
BUSY_GAP_S = 0.010
# A step this many times its kind's median ratio is a one-off (the first use of a kernel, a stall), not the spread
# of served steps: a simulated step drawing it would make a tail no other run has.
OUTLIER_RATIO = 3.0


@dataclass(frozen=True)
class TracedWorker:
    """One worker's trace file: its header and its steps, each with the time it ended."""

    path: str
    header: dict[str, Any]
    steps: list[tuple[float, ProfileSample]]
    lines_skipped: int

    @property
    def role(self) -> str:
        return str(self.header.get("role", "both"))  # traces written before roles were named: a colocated worker


@dataclass(frozen=True)
class TracedSteps:
    """The steps of one or more trace files of one engine configuration."""

    header: dict[str, Any]
    steps: list[ProfileSample]
    files: tuple[str, ...]
    lines_skipped: int  # lines that were not a step (a worker killed mid-line leaves one)


def trace_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files named, a directory standing for its steps-*.jsonl."""
    files: list[Path] = []
    for p in map(Path, paths):
        found = sorted(p.glob("steps-*.jsonl")) if p.is_dir() else [p]
        if not found:
            raise ProfileError(f"{p}: no steps-*.jsonl in that directory (was the server run with --step-trace?)")
        files += found
    return files


def read_workers(paths: Sequence[str | Path]) -> list[TracedWorker]:
    """Every worker's trace in `paths`; ProfileError if one is not a step trace or they trace different engines
    (the roles of one deployment may differ)."""
    workers = [read_worker(path) for path in trace_files(paths)]
    first = workers[0]
    for w in workers[1:]:
        differ = [k for k in SAME_ENGINE if w.header.get(k) != first.header.get(k)]
        if differ:
            raise ProfileError(f"{w.path} traces another engine than {first.path} ({', '.join(differ)} differ): fit "
                               "one configuration's workers at a time")
    if not any(w.steps for w in workers):
        raise ProfileError(f"{', '.join(w.path for w in workers)}: no steps traced (no request reached the engine?)")
    return workers


def read_traces(paths: Sequence[str | Path]) -> TracedSteps:
    """Every step of the files, whatever worker ran it."""
    workers = read_workers(paths)
    return TracedSteps(workers[0].header, [step for w in workers for _, step in w.steps],
                       tuple(w.path for w in workers), sum(w.lines_skipped for w in workers))


def read_worker(path: Path) -> TracedWorker:
    header, lines = _read_file(path)
    steps = [step for step in map(_step, lines) if step is not None]
    return TracedWorker(str(path), header, steps, len(lines) - len(steps))


def _read_file(path: Path) -> tuple[dict[str, Any], list[str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ProfileError(f"cannot read step trace {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path} is not a step trace (not text)") from exc
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise ProfileError(f"{path} is not a step trace (its first line is not a {TRACE_FORMAT} header)")
    return header, lines[1:]


def _step(line: str) -> tuple[float, ProfileSample] | None:
    """(when the step ended, the step); None for a line that is not one."""
    try:
        d = json.loads(line)
        shape, seconds, ended = d["shape"], float(d["seconds"]), float(d["t"])
        values = [shape[k] for k in SHAPE_FIELDS]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if not all(type(v) is int and v >= 0 for v in values) or not all(map(math.isfinite, (seconds, ended))) \
            or seconds <= 0:
        return None
    step = StepShape(*values)
    return None if step.is_empty else (ended, ProfileSample(step, seconds))


def condense(steps: Sequence[ProfileSample], max_samples: int = MAX_SAMPLES,
             seed: int = 0) -> list[tuple[ProfileSample, int]]:
    """One sample per distinct shape, its steps' median seconds, with how many steps it stands for."""
    by_shape: dict[StepShape, list[float]] = defaultdict(list)
    for s in steps:
        by_shape[s.shape].append(s.seconds)
    condensed = [(ProfileSample(shape, statistics.median(t)), len(t)) for shape, t in by_shape.items()]
    condensed.sort(key=lambda c: (c[0].shape.num_tokens, c[0].shape.decode_context, c[0].shape.prefill_attended))
    if len(condensed) > max_samples:
        keep = sorted(random.Random(seed).sample(range(len(condensed)), max_samples))
        condensed = [condensed[i] for i in keep]
    return condensed


@dataclass(frozen=True)
class KindComparison:
    """Served steps of one kind over what a profile predicts for their shapes."""

    kind: str
    steps: int
    served_s: float  # their seconds, summed
    median_ratio: float  # of served / predicted, per step
    p90_ratio: float
    time_ratio: float  # summed served seconds / summed predicted seconds

    def describe(self) -> str:
        return (f"{self.kind:<8} {self.steps:>7} steps, {self.served_s:8.2f} s served: served / profile median "
                f"{self.median_ratio:.2f}, p90 {self.p90_ratio:.2f}, in total {self.time_ratio:.2f}")


def compare(steps: Sequence[ProfileSample], model: ProfiledLatency) -> list[KindComparison]:
    ratios: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in steps:
        ratios[s.shape.kind].append((s.seconds, model.step_seconds(s.shape)))
    out = []
    for kind in ("decode", "prefill", "mixed"):
        pairs = ratios.get(kind)
        if not pairs:
            continue
        per_step = sorted(t / p for t, p in pairs)
        out.append(KindComparison(kind, len(pairs), sum(t for t, _ in pairs), statistics.median(per_step),
                                  per_step[min(len(per_step) - 1, int(0.9 * len(per_step)))],
                                  sum(t for t, _ in pairs) / sum(p for _, p in pairs)))
    return out


def fit_steps(traced: TracedSteps) -> dict[str, Any]:
    """A step profile (the `kvbaton sim profile` format) of the traced steps."""
    samples = condense(traced.steps)
    h = traced.header
    label = f"{h.get('model')}, {h.get('dtype')}, {h.get('threads')} threads, served steps"
    model = ProfiledLatency.fit([s for s, _ in samples], label)
    engine = {k: v for k, v in h.items() if k != "format"}
    return {"format": PROFILE_FORMAT, **engine,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "source": {"step_traces": list(traced.files), "steps": len(traced.steps),
                       "lines_skipped": traced.lines_skipped, "distinct_shapes_fitted": len(samples)},
            "samples": [{"kind": s.shape.kind, "shape": dataclasses.asdict(s.shape), "seconds": s.seconds,
                         "steps": n} for s, n in samples],
            "latency_model": model.to_dict()}


def served_steps(workers: Sequence[TracedWorker], profile: StepLatencyModel,
                 profile_engine: dict[str, Any]) -> dict[str, ServedSteps]:
    """Per role, how the traced steps compare with `profile` (of the engine `profile_engine` describes)."""
    differ = [k for k in SAME_ENGINE if k in profile_engine and workers[0].header.get(k) != profile_engine[k]]
    if differ:
        raise ProfileError(f"the step traces ran another engine than the profile ({', '.join(differ)} differ): "
                           "profile the engine the deployment serves with")
    by_role: dict[str, list[TracedWorker]] = defaultdict(list)
    for w in workers:
        if w.steps:
            by_role[w.role].append(w)
    return {role: _served(group, profile) for role, group in sorted(by_role.items())}


def _served(workers: Sequence[TracedWorker], profile: StepLatencyModel) -> ServedSteps:
    prompt: list[list[float]] = [[] for _ in BUCKET_NAMES]
    decode: list[float] = []
    gaps: list[float] = []
    for w in workers:
        for _, s in w.steps:
            ratio = s.seconds / profile.step_seconds(s.shape)
            (prompt[prompt_bucket(s.shape.prefill_tokens)] if s.shape.prefill_tokens else decode).append(ratio)
        for (ended, _), (next_ended, step) in itertools.pairwise(w.steps):
            gap = next_ended - step.seconds - ended
            if gap < BUSY_GAP_S:
                gaps.append(max(gap, 0.0))  # the clock of `t` and the step's timer differ by microseconds
    prompt_ratios = tuple(_typical(bucket) for bucket in prompt)
    if not any(prompt_ratios):  # a role that never ran a prompt (a decode worker of long prompts only)
        prompt_ratios = ((1.0,), *prompt_ratios[1:])
    return ServedSteps(prompt_ratios=BySize(prompt_ratios), decode_ratios=_typical(decode) or (1.0,),
                       gap_s=statistics.fmean(gaps) if gaps else 0.0, num_steps=sum(len(w.steps) for w in workers))


def _typical(ratios: list[float]) -> tuple[float, ...]:
    """The ratios' quantiles without one-off outliers; () when the role ran no such step."""
    if not ratios:
        return ()
    median = statistics.median(ratios)
    return quantiles([r for r in ratios if r <= OUTLIER_RATIO * median])
