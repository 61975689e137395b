"""Served steps as a cost model sees them: each engine step's shape and seconds, one JSON line each.

`--step-trace DIR` (serve, generate) makes every engine append to `DIR/steps-<pid>.jsonl`:

    {"format": "kvbaton-step-trace/1", "model": ..., "threads": ..., "role": "both", ...}   header: the engine
    {"t": 1796198400.12, "seconds": 0.0213, "shape": {"prefill_tokens": 0, ..., "decode_seqs": 5, ...}}
    {..., "afd": {"micro_batches": 2, "wait_s": 0.0081, "attention_bubble": 0.38}}   an AFD attention worker's step

Why: `kvbaton sim profile` times crafted steps on an engine alone; a served step shares the machine with
the frontend (HTTP, tokenizer, detokenizer, IPC), other workers and KV transfers. `kvbaton sim fit-steps`
fits a step profile to what the served steps cost, and comparing the two tells how much of a served
latency is the engine's own (see `kvbaton.sim.served_steps`).

A step's seconds are those `sim profile` times: scheduling, the model, and the scheduler's update. Only
steps that compute a token are written. Bounded: the file stops after `max_steps` lines. Tracing never
fails a step: a write that fails turns it off, with one warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from kvbaton.sched.step_shape import StepShape

logger = logging.getLogger(__name__)

TRACE_FORMAT = "kvbaton-step-trace/1"
PROFILE_FORMAT = "kvbaton-step-profile/1"  # what `sim profile` and `sim fit-steps` write
MAX_TRACE_STEPS = 1_000_000  # about 150 MB of lines: a day of a busy worker
FLUSH_EVERY_S = 1.0  # a reader (or a killed worker) misses at most the last second of steps


class StepTrace:
    """One engine's trace file, opened for appending; `record` per step, `close` at the end."""

    def __init__(self, path: Path, header: dict[str, Any], max_steps: int = MAX_TRACE_STEPS) -> None:
        self.path, self.max_steps = path, max_steps
        self.steps = 0
        self._file: IO[str] | None = None
        self._flushed_at = time.monotonic()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1 << 16)
            self._write({"format": TRACE_FORMAT, **header})
            if self._file is not None:
                self._file.flush()  # the file says whose it is before any step
        except OSError as exc:
            self._off(exc)

    @classmethod
    def in_dir(cls, directory: str | Path, header: dict[str, Any], max_steps: int = MAX_TRACE_STEPS) -> StepTrace:
        """This process's trace in `directory` (one file per process: a pool's workers never share one)."""
        return cls(Path(directory) / f"steps-{os.getpid()}.jsonl", header, max_steps)

    def record(self, shape: StepShape, seconds: float, afd: dict[str, Any] | None = None) -> None:
        """One step; `afd`: an attention worker's micro-batches, its wait for the expert pool and that wait's
        share of the model's time (its bubble) in this step."""
        if self._file is None or shape.is_empty:
            return
        if self.steps >= self.max_steps:
            logger.warning("step trace %s: %d steps written, the most it takes; tracing stops", self.path,
                           self.steps)
            self.close()
            return
        self.steps += 1
        line = {"t": round(time.time(), 6), "seconds": seconds, "shape": dataclasses.asdict(shape)}
        self._write(line if afd is None else {**line, "afd": afd})
        if self._file is not None and time.monotonic() - self._flushed_at >= FLUSH_EVERY_S:
            self._flushed_at = time.monotonic()
            try:
                self._file.flush()
            except OSError as exc:
                self._off(exc)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                logger.warning("step trace %s: closing failed (%s)", self.path, exc)
            self._file = None

    def _write(self, line: dict[str, Any]) -> None:
        assert self._file is not None
        try:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        except (OSError, ValueError) as exc:  # ValueError: the file was closed under us
            self._off(exc)

    def _off(self, exc: BaseException) -> None:
        logger.warning("step trace %s: %s; tracing is off for this engine (its steps go on)", self.path, exc)
        self.close()
