"""Drive one load level: send each request at its arrival time, gather the records.

    t=0        offsets[1]   offsets[2]  ...          deadline (--max-duration-s)
    |--send 0--|--send 1----|--send 2--- ... ---------|  in-flight requests cancelled here,
                                                         unsent ones never go out
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import numpy as np
from tqdm import tqdm

from kvbaton.bench.client import Target, make_client, send_request
from kvbaton.workload.arrivals import ArrivalConfig, arrival_offsets
from kvbaton.workload.datasets import BenchRequest
from kvbaton.workload.records import RequestRecord, RunResult


async def run_load(target: Target, requests: list[BenchRequest], arrivals: ArrivalConfig, seed: int,
                   max_duration_s: float | None = None, show_progress: bool = True) -> RunResult:
    """Send `requests` open-loop at `arrivals`' rate; stop early at `max_duration_s`."""
    offsets = arrival_offsets(len(requests), arrivals, np.random.default_rng([seed, 1]))
    limit = asyncio.Semaphore(arrivals.max_concurrency) if arrivals.max_concurrency else None
    label = "inf" if math.isinf(arrivals.request_rate) else f"{arrivals.request_rate:g}"
    with tqdm(total=len(requests), desc=f"rate {label} req/s", unit="req",
              disable=None if show_progress else True) as bar:
        async with make_client(target) as client:
            start = time.perf_counter()
            deadline = start + max_duration_s if max_duration_s else math.inf
            tasks = await _issue(client, target, requests, offsets.tolist(), start, deadline, limit, bar)
            end = await _drain(list(tasks), deadline)
    records = tuple(_record_of(task, req, offset) for task, (req, offset) in tasks.items())
    return RunResult(arrivals.request_rate, arrivals.max_concurrency, end - start, len(requests), records)


async def _issue(client: httpx.AsyncClient, target: Target, requests: list[BenchRequest], offsets: list[float],
                 start: float, deadline: float, limit: asyncio.Semaphore | None,
                 bar: tqdm) -> dict[asyncio.Task, tuple[BenchRequest, float]]:
    tasks: dict[asyncio.Task, tuple[BenchRequest, float]] = {}
    for req, offset in zip(requests, offsets):
        send_at = start + offset
        if send_at >= deadline:
            break
        await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
        task = asyncio.create_task(_send(client, target, req, start, offset, limit))
        task.add_done_callback(lambda _: bar.update(1))
        tasks[task] = (req, offset)
    return tasks


async def _send(client: httpx.AsyncClient, target: Target, req: BenchRequest, start: float, offset: float,
                limit: asyncio.Semaphore | None) -> RequestRecord:
    if limit is None:
        return await send_request(client, target, req, start, offset)
    async with limit:
        return await send_request(client, target, req, start, offset)


async def _drain(tasks: list[asyncio.Task], deadline: float) -> float:
    """Wait for every request or the deadline, whichever is first; returns the end time."""
    if not tasks:
        return time.perf_counter()
    timeout = None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    end = time.perf_counter()
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return min(end, deadline)


def _record_of(task: asyncio.Task, req: BenchRequest, offset: float) -> RequestRecord:
    if task.cancelled():
        return RequestRecord(req.request_id, req.prompt_len, req.output_len, scheduled_s=offset, send_s=offset,
                             status="cancelled", error="still running at --max-duration-s")
    return task.result()
