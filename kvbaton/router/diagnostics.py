"""The pool's side of the diagnostics (`/admin/diagnostics/*`, `kvbaton doctor`): which workers run which probe
(`worker.probes`), in what order, and the figures their reports add up to. Torch-free: it runs in the frontend.

    kv transfer, per (prefill -> decode) pair, one pair at a time:
        decode  <- ProbeReceive     -> ProbeReady(its probe receiver's address)
        prefill <- ProbeSend        -> ProbeReport(each transfer's time)      decode -> ProbeReport(all arrived?)
    all-reduce, over every routable worker:
        rank 0  <- ProbeAllReduce   -> ProbeReady(its store's host:port)
        ranks   <- ProbeAllReduce   -> ProbeReport(each all-reduce's time), from every rank
    profile, on each worker asked:  <- ProbeProfile -> ProbeReport(its steps' profile)

One diagnostic at a time (`DiagnosticBusy` otherwise). A worker that does not answer in time (it died, it is
stuck) is reported as such in the result, never waited for beyond the probe's deadline.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvbaton.messages.router_worker import (
    ProbeAllReduce,
    ProbeProfile,
    ProbeReady,
    ProbeReceive,
    ProbeReport,
    ProbeSend,
    StepProfile,
    Timing,
)
from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.router.errors import EngineError

if TYPE_CHECKING:
    from kvbaton.router.worker_pool import WorkerHandle, WorkerPool

T = TypeVar("T")
MAX_PAIRS = 16  # prefill -> decode pairs probed per call (a big pool: the first ones)
ANSWER_MARGIN_S = 5.0  # a worker's report may arrive this long after the probe's own deadline


class DiagnosticBusy(EngineError):
    """Another diagnostic is running (the server answers 409)."""

    http_status = 409
    err_type = "ConflictError"


class PoolDiagnostics:
    def __init__(self, pool: WorkerPool, routing: Callable[[], dict[str, Any]], counters: dict[str, int]) -> None:
        self.pool = pool
        self._routing, self._counters = routing, counters  # routing(): the router's settings as they are now
        self._waiting: dict[tuple[str, str, type], asyncio.Future] = {}  # (probe id, worker, reply kind)
        self._lock = asyncio.Lock()

    def on_reply(self, worker: str, msg: ProbeReady | ProbeReport) -> None:
        future = self._waiting.get((msg.probe_id, worker, type(msg)))
        if future is not None and not future.done():
            future.set_result(msg)

    def routing(self) -> dict[str, Any]:
        """How the router splits prompts between the pools, and how it went so far."""
        live = [w for w in self.pool.workers.values() if w.routable]
        return {**self._routing(), "kv_transport": self.pool.connector.transport,
                "num_prefill": sum(w.role == WorkerRole.PREFILL for w in live),
                "num_decode": sum(w.role.decodes for w in live), "counters": dict(self._counters)}

    # ---- the diagnostics ---------------------------------------------------------------------

    async def kv_transfer(self, *, small_bytes: int, large_bytes: int, repeats: int, timeout_s: float) -> dict:
        """Each (prefill -> decode) pair: `repeats` scratch transfers of about `small_bytes` (latency), then of
        about `large_bytes` (bandwidth), over the deployment's KV transport."""
        return await self._exclusive(lambda: self._kv_transfer(small_bytes, large_bytes, repeats, timeout_s))

    async def all_reduce(self, *, sizes: list[int], iters: int, timeout_s: float) -> dict:
        return await self._exclusive(lambda: self._all_reduce(sizes, iters, timeout_s))

    async def profile(self, *, names: list[str] | None, num_steps: int, max_duration_s: float) -> dict:
        return await self._exclusive(lambda: self._profile(names, num_steps, max_duration_s))

    async def _exclusive(self, run: Callable[[], Awaitable[T]]) -> T:
        if self._lock.locked():
            raise DiagnosticBusy("another diagnostic is running; one at a time")
        async with self._lock:
            return await run()

    async def _kv_transfer(self, small_bytes: int, large_bytes: int, repeats: int, timeout_s: float) -> dict:
        prefill = self.pool.routable(WorkerRole.PREFILL)
        decode = [w for w in self.pool.routable(WorkerRole.DECODE) if w.role == WorkerRole.DECODE]
        pairs = [(p, d) for p in prefill for d in decode]
        result: dict[str, Any] = {"transport": self.pool.connector.transport, "pairs": []}
        if not pairs:
            result["skipped"] = "no prefill -> decode pair: a colocated deployment moves no KV between workers"
        elif len(pairs) > MAX_PAIRS:
            result["skipped"] = f"{len(pairs) - MAX_PAIRS} pairs beyond the first {MAX_PAIRS} were not probed"
        for p, d in pairs[:MAX_PAIRS]:
            per_block = p.kv_layout.bytes_per_block
            small, large = (max(1, math.ceil(n / per_block)) for n in (small_bytes, large_bytes))
            result["pairs"].append(await self._probe_pair(p, d, [small] * repeats + [large] * repeats, timeout_s))
        return result

    async def _probe_pair(self, p: WorkerHandle, d: WorkerHandle, counts: list[int], timeout_s: float) -> dict:
        probe_id = _probe_id("kv")
        row: dict[str, Any] = {"prefill": p.name, "decode": d.name, "error": None}
        ready, received = self._expect(probe_id, d, ProbeReady), self._expect(probe_id, d, ProbeReport)
        sent = self._expect(probe_id, p, ProbeReport)
        try:
            await self.pool.send(d, ProbeReceive(probe_id=probe_id, block_counts=counts, deadline_s=timeout_s))
            await asyncio.wait({ready, received}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                row["error"] = _answer(received, d.name) or f"{d.name} did not start its probe receiver in time"
                return row
            await self.pool.send(p, ProbeSend(probe_id=probe_id, receiver=ready.result().address, layout=d.kv_layout,
                                              block_counts=counts, deadline_s=timeout_s))
            await asyncio.wait({sent, received}, timeout=timeout_s + ANSWER_MARGIN_S)
            row["error"] = _answer(sent, p.name) or _answer(received, d.name)
            if sent.done():
                n = len(counts) // 2
                timings = sent.result().timings
                row["small"], row["large"] = _transfers(timings[:n]), _transfers(timings[n:])
        finally:
            self._forget(probe_id)
        return row

    async def _all_reduce(self, sizes: list[int], iters: int, timeout_s: float) -> dict:
        ranks = [w for w in self.pool.workers.values() if w.routable]
        result: dict[str, Any] = {"backend": "gloo", "world_size": len(ranks), "workers": [w.name for w in ranks],
                                  "sizes": [], "error": None}
        if len(ranks) < 2:
            result["skipped"] = "one worker: nothing to all-reduce with"
            return result
        probe_id = _probe_id("allreduce")
        ready = self._expect(probe_id, ranks[0], ProbeReady)
        reports = [self._expect(probe_id, w, ProbeReport) for w in ranks]
        try:
            probe = ProbeAllReduce(probe_id=probe_id, rank=0, world_size=len(ranks), store="", sizes=sizes,
                                   iters=iters, deadline_s=timeout_s)
            await self.pool.send(ranks[0], probe)
            await asyncio.wait({ready, reports[0]}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                result["error"] = _answer(reports[0], ranks[0].name) or f"{ranks[0].name} did not host the group"
                return result
            for rank, worker in enumerate(ranks[1:], start=1):
                await self.pool.send(worker, msgspec.structs.replace(probe, rank=rank, store=ready.result().address))
            await asyncio.wait(set(reports), timeout=timeout_s + ANSWER_MARGIN_S)
            errors = [e for f, w in zip(reports, ranks) if (e := _answer(f, w.name))]
            result["error"] = errors[0] if errors else None
            if not errors:
                result["sizes"] = _collectives([f.result().timings for f in reports], sizes, iters, len(ranks))
        finally:
            self._forget(probe_id)
        return result

    async def _profile(self, names: list[str] | None, num_steps: int, max_duration_s: float) -> dict:
        live = [w for w in self.pool.workers.values() if w.routable]
        targets = live if names is None else [w for w in live if w.name in names]
        missing = sorted(set(names or ()) - {w.name for w in targets})
        if missing:
            raise KeyError(", ".join(missing))
        probe_id = _probe_id("profile")
        reports = [self._expect(probe_id, w, ProbeReport) for w in targets]
        try:
            for worker in targets:
                await self.pool.send(worker, ProbeProfile(probe_id=probe_id, num_steps=num_steps,
                                                          max_duration_s=max_duration_s))
            await asyncio.wait(set(reports), timeout=max_duration_s + ANSWER_MARGIN_S)
        finally:
            self._forget(probe_id)
        return {"workers": [_profiled(w, f) for w, f in zip(targets, reports)]}

    # ---- replies -----------------------------------------------------------------------------

    def _expect(self, probe_id: str, worker: WorkerHandle, kind: type) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._waiting[(probe_id, worker.name, kind)] = future
        return future

    def _forget(self, probe_id: str) -> None:
        for key in [k for k in self._waiting if k[0] == probe_id]:
            self._waiting.pop(key).cancel()


def _probe_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def _answer(future: asyncio.Future, name: str) -> str | None:
    """A report's error; or that none came."""
    if not future.done() or future.cancelled():
        return f"{name} did not answer in time"
    report: ProbeReport = future.result()
    return f"{name}: {report.error}" if report.error else None


def _transfers(timings: list[Timing]) -> dict[str, Any]:
    if not timings:
        return {}
    seconds = statistics.median(t.seconds for t in timings)
    return {"num_bytes": timings[0].num_bytes, "num_blocks": timings[0].num_blocks, "samples": len(timings),
            "median_ms": seconds * 1e3, "min_ms": min(t.seconds for t in timings) * 1e3,
            "gbps": timings[0].num_bytes / seconds / 1e9 if seconds > 0 else 0.0}


def _collectives(per_rank: list[list[Timing]], sizes: list[int], iters: int, world: int) -> list[dict[str, Any]]:
    """Per size: an all-reduce ends when its last rank does, so each iteration's time is its slowest rank's;
    bus bandwidth as nccl-tests defines it (algorithm bandwidth x 2(n-1)/n)."""
    rows = []
    for i, size in enumerate(sizes):
        runs = [timings[i * iters:(i + 1) * iters] for timings in per_rank]
        slowest = [max(run[k].seconds for run in runs) for k in range(iters)]
        seconds = statistics.median(slowest)
        algbw = runs[0][0].num_bytes / seconds / 1e9 if seconds > 0 else 0.0
        rows.append({"num_bytes": runs[0][0].num_bytes, "requested_bytes": size, "iters": iters,
                     "median_us": seconds * 1e6, "min_us": min(slowest) * 1e6, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * 2 * (world - 1) / world})
    return rows


def _profiled(worker: WorkerHandle, future: asyncio.Future) -> dict[str, Any]:
    row: dict[str, Any] = {"name": worker.name, "role": worker.role.value,
                           "compute_path": worker.engine_info.compute_path, "error": _answer(future, worker.name)}
    profile: StepProfile | None = future.result().profile if future.done() and not future.cancelled() else None
    if profile is None:
        return row
    step_s = max(profile.step_s, 1e-9)
    row.update({"num_steps": profile.num_steps, "step_ms": profile.step_s / max(profile.num_steps, 1) * 1e3,
                "compute_share": min(1.0, profile.compute_s / step_s),
                "outside_ops_share": max(0.0, 1.0 - profile.op_self_s / step_s),
                "top_ops": [{"name": op.name, "self_ms": op.self_s * 1e3, "count": op.count,
                             "share": op.self_s / step_s} for op in profile.top_ops]})
    row["outside_compute_share"] = 1.0 - row["compute_share"]
    return row
