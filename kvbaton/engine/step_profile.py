"""`kvbaton sim profile`: this machine's engine step time as a function of the step's shape.

Builds the engine a server would (the same EngineConfig: model, dtype, threads, kernels, compute
path) and drives it through crafted batches, one grid point at a time:

    decode   D sequences decoding at context L         their prompts' KV "received", as a decode
                                                        worker's is (no prefill to wait for)
    prefill  one chunk of P tokens after C cached ones  the C cached through the prefix cache
    mixed    a prefill chunk and D decodes in one step  chunked prefill; PD interference

A visit to a point crafts its batch, takes two steps of it and clears the engine again: the first
warms up (first-use costs: kernel builds, oneDNN's primitives per row count; and the caches left as
a run of such steps leaves them, as in a server, where consecutive steps are alike), the second is
timed. The grid is visited `repeats` times, each pass in its own shuffled order, and a point's
sample is the median of its visits, with the shape the scheduler actually scheduled. NOTE: passes
rather than back-to-back repeats, so a burst of load from elsewhere on the machine lands on one
visit of many points, not on every visit of a few (which the median could not undo, and the fit
would learn as a shape effect).

The simulator's side (the shape a cost model sees, and the fit) is handed in by the CLI parser as
`args.profile_fit`: the engine layer may not import the simulator.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvbaton.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from kvbaton.engine.core import EngineCore
from kvbaton.engine.engine import LLMEngine
from kvbaton.models.registry import DEFAULT_MODEL
from kvbaton.sched.outputs import ScheduledRequest, SchedulerOutput
from kvbaton.sched.request import Request
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.sched.step_trace import PROFILE_FORMAT

VISIT_STEPS = 2  # a warm-up step, then the timed one


class ProfileFit(Protocol):
    """What the profiler needs of the simulator (`kvbaton.sim.profiled.ProfileFit`)."""

    def shape(self, scheduled: Sequence[ScheduledRequest]) -> dict[str, int]:
        """The step's shape, as a cost model sees it (StepShape's fields)."""
        ...

    def fit(self, samples: Sequence[tuple[Mapping[str, int], float]], label: str = "") -> dict[str, Any]:
        """The fitted model of (shape, seconds) samples, as the profile's `latency_model` section."""
        ...


@dataclass(frozen=True, kw_only=True)
class ProfilePoint:
    """One crafted step: a prefill chunk of `prefill_tokens` after `prefill_cached` cached tokens (0: none)
    and `decode_seqs` sequences decoding at context `decode_context`."""

    prefill_tokens: int = 0
    prefill_cached: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill_tokens and self.decode_seqs else "prefill" if self.prefill_tokens else "decode"


@dataclass(frozen=True, kw_only=True)
class ProfileGrid:
    decode_seqs: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_cached: tuple[int, ...]
    mixed_prefill_tokens: tuple[int, ...]
    mixed_cached: tuple[int, ...]
    mixed_decode_seqs: tuple[int, ...]
    mixed_context: int
    repeats: int  # passes over the grid, one timed step of each point each

    def points(self) -> list[ProfilePoint]:
        decode = [ProfilePoint(decode_seqs=d, decode_context=c)
                  for c, d in itertools.product(self.decode_contexts, self.decode_seqs)]
        prefill = [ProfilePoint(prefill_tokens=p, prefill_cached=c)
                   for c, p in itertools.product(self.prefill_cached, self.prefill_tokens)]
        mixed = [ProfilePoint(prefill_tokens=p, prefill_cached=c, decode_seqs=d, decode_context=self.mixed_context)
                 for c, d, p in itertools.product(self.mixed_cached, self.mixed_decode_seqs, self.mixed_prefill_tokens)]
        return decode + prefill + mixed


# NOTE: sized for ~2 minutes on 2 cores with the default model in bf16 (the long prefill chunks cost most).
# Mixed steps up to a 1536-token chunk: a full step budget of chunked prefill beside its decodes.
DEFAULT_GRID = ProfileGrid(decode_seqs=(1, 2, 4, 8, 16, 32, 64), decode_contexts=(128, 512, 1024, 2048),
                           prefill_tokens=(16, 32, 64, 128, 256, 512, 1024, 2048), prefill_cached=(0, 512, 1024),
                           mixed_prefill_tokens=(16, 128, 512, 1536), mixed_cached=(0, 1024),
                           mixed_decode_seqs=(4, 16, 32), mixed_context=1024, repeats=3)
QUICK_GRID = ProfileGrid(decode_seqs=(1, 4), decode_contexts=(32, 96), prefill_tokens=(16, 64), prefill_cached=(0, 32),
                         mixed_prefill_tokens=(16,), mixed_cached=(0,), mixed_decode_seqs=(2, 4), mixed_context=64,
                         repeats=2)


@dataclass(frozen=True, kw_only=True)
class StepSample:
    point: ProfilePoint
    shape: dict[str, int]  # of the median step, as scheduled
    seconds: float  # the median of the timed visits
    repeats: tuple[float, ...]  # every timed visit's, in pass order

    @classmethod
    def of(cls, point: ProfilePoint, visits: list[tuple[float, dict[str, int]]]) -> StepSample:
        seconds, shape = sorted(visits, key=lambda v: v[0])[len(visits) // 2]
        return cls(point=point, shape=shape, seconds=seconds, repeats=tuple(t for t, _ in visits))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.point.kind, "point": asdict(self.point), "shape": self.shape, "seconds": self.seconds,
                "repeats": list(self.repeats)}


def timed_step(core: EngineCore) -> tuple[SchedulerOutput, float]:
    """One engine step, timed, and what it scheduled.

    NOTE: EngineCore.step's own work less its KV-store and grammar bookkeeping (a profile has neither),
    so the profiler sees the SchedulerOutput it times; scheduling counts, as it does in a real step."""
    start = time.perf_counter()
    sched = core.scheduler.schedule()
    output = core.runner.execute(sched)
    core.scheduler.update_from_output(sched, output)
    core.kv_cache.drain_new_blocks()
    return sched, time.perf_counter() - start


class StepProfiler:
    """Crafts each grid point's batch on `core` and times its steps; every point starts and ends empty."""

    def __init__(self, core: EngineCore, fit: ProfileFit, seed: int = 0) -> None:
        self.core, self.fit = core, fit
        self.rng = random.Random(seed)
        self.ids = itertools.count()

    def fits(self, point: ProfilePoint) -> bool:
        """Whether the point's tokens fit the model's length and the KV pool."""
        longest = max(point.decode_context, point.prefill_cached + point.prefill_tokens)
        blocks = (point.decode_seqs * -(-point.decode_context // self.core.info.block_size)
                  + 2 * -(-(point.prefill_cached + point.prefill_tokens) // self.core.info.block_size))
        # NOTE: strictly shorter: a request that reaches the model's length is finished before it decodes on
        return longest < self.core.info.max_model_len and blocks <= self.core.info.num_blocks

    def visit(self, point: ProfilePoint) -> tuple[float, dict[str, int]]:
        """The point's batch, its last step timed: (seconds, that step's shape as scheduled)."""
        # each decode moves one position a step: the timed step is the one at the point's context
        decoders = [self._decoder(point.decode_context - VISIT_STEPS + 1) for _ in range(point.decode_seqs)]
        prefix = self._cached_prefix(point.prefill_cached)
        for _ in range(VISIT_STEPS):
            if point.prefill_tokens:
                self._add_prefill(prefix + self._tokens(point.prefill_tokens))
            sched, seconds = timed_step(self.core)
        self.core.abort_requests(decoders)
        assert not self.core.has_own_requests(), "a profile point left requests behind"
        return seconds, self.fit.shape(sched.scheduled)

    def _tokens(self, n: int) -> list[int]:
        """Random ids: no two prompts share a block, so only the intended prefix hits the cache."""
        return self.rng.choices(range(self.core.info.vocab_size), k=n)

    def _decoder(self, context: int) -> str:
        """A request decoding its first output token at `context` positions, its prompt's KV taken as received
        (the pool's blocks hold whatever they hold: the time of a step does not depend on the values)."""
        req = self.core.new_request(f"profile-decode-{next(self.ids)}", self._tokens(context - 1),
                                    SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0.0))
        self._receive(req, first_token=self._tokens(1)[0])
        return req.request_id

    def _cached_prefix(self, length: int) -> list[int]:
        """`length` tokens whose KV is in the prefix cache (received, then freed: its full blocks stay cached)."""
        if not length:
            return []
        req = self.core.new_request(f"profile-prefix-{next(self.ids)}", self._tokens(length), SamplingParams())
        self._receive(req, first_token=0)
        self.core.abort_requests([req.request_id])
        return req.prompt_token_ids

    def _receive(self, req: Request, first_token: int) -> None:
        """Take `req`'s prompt KV as received from a prefill worker: it decodes from its next step."""
        if self.core.scheduler.reserve_for_transfer(req) is None:
            raise RuntimeError("the KV pool is full (`fits` let through a point it cannot hold)")
        self.core.scheduler.admit_transferred(req.request_id, first_token)

    def _add_prefill(self, prompt: list[int]) -> None:
        """A request whose whole uncached prompt is one step's chunk; its one output token ends it."""
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        self.core.add_request(self.core.new_request(f"profile-prefill-{next(self.ids)}", prompt, params))


def engine_config(args: argparse.Namespace, grid: ProfileGrid) -> EngineConfig:
    """The server's config for these flags; the step budget and sequence limit fit the grid's largest steps
    (they bound what is scheduled, not what a step of a given shape costs)."""
    points = grid.points()
    return EngineConfig(
        model=args.model or DEFAULT_MODEL, dtype=args.dtype, num_threads=args.threads, kernels=not args.no_kernels,
        compute_path=args.compute_path,
        cache=CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb),
        scheduler=SchedulerConfig(max_num_seqs=max(p.decode_seqs for p in points) + 1,
                                  max_num_batched_tokens=max(p.prefill_tokens + p.decode_seqs for p in points),
                                  decode_burst=1))  # one step of each shape at a time


def profile(engine: LLMEngine, grid: ProfileGrid, fit: ProfileFit,
            seed: int = 0) -> tuple[list[StepSample], list[ProfilePoint]]:
    """(the samples, in the grid's order; the points that do not fit this model or pool)."""
    profiler = StepProfiler(engine.core, fit, seed)
    points = [p for p in grid.points() if profiler.fits(p)]
    visits: dict[ProfilePoint, list[tuple[float, dict[str, int]]]] = {p: [] for p in points}
    order = random.Random(seed)
    for n in range(grid.repeats):
        start = time.perf_counter()
        for point in order.sample(points, len(points)):
            visits[point].append(profiler.visit(point))
        print(f"  pass {n + 1}/{grid.repeats}: {len(points)} points in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    samples = [StepSample.of(p, visits[p]) for p in points]
    for s in samples:
        print(f"  {s.point.kind:<7} {_describe(s.point):<28} {s.seconds * 1e3:8.1f} ms", file=sys.stderr)
    return samples, [p for p in grid.points() if p not in visits]


def _describe(p: ProfilePoint) -> str:
    parts = [f"P={p.prefill_tokens} C={p.prefill_cached}"] if p.prefill_tokens else []
    return " ".join(parts + ([f"D={p.decode_seqs} L={p.decode_context}"] if p.decode_seqs else []))


def profile_report(engine: LLMEngine, samples: list[StepSample], fit: ProfileFit, wall_s: float) -> dict[str, Any]:
    description = engine.core.cost_description()
    label = f"{description['model']}, {description['dtype']}, {description['threads']} threads"
    return {
        "format": PROFILE_FORMAT, **description,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "profile_seconds": round(wall_s, 1),
        "samples": [s.to_dict() for s in samples],
        "latency_model": fit.fit([(s.shape, s.seconds) for s in samples], label),
    }


def main(args: argparse.Namespace) -> int:
    """`kvbaton sim profile`: measure, fit, write the JSON profile to `args.out`."""
    out = Path(args.out)
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: must be at least 1")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: no directory {out.parent}")
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    fit: ProfileFit = args.profile_fit()
    start = time.perf_counter()
    engine = LLMEngine(engine_config(args, grid))
    print(f"profiling {engine.model_dir.name} ({engine.core.compute_plan.summary()}), "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    samples, skipped = profile(engine, grid, fit)
    if not samples:
        raise ConfigError("no profile point fits this model's length and KV pool (try --kv-cache-memory-gb)")
    report = profile_report(engine, samples, fit, time.perf_counter() - start)
    out.write_text(json.dumps(report, indent=1) + "\n")
    error = report["latency_model"]["fit_error"]
    print(f"{len(samples)} samples ({len(skipped)} points skipped: too long for the model or pool) in "
          f"{report['profile_seconds']} s; {report['latency_model']['form']}, held-out error median "
          f"{error['median_ape']:.1%}, p90 {error['p90_ape']:.1%} -> {out}")
    return 0
