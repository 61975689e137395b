"""A real router over real worker processes, for the disaggregation and fault tests (the one PD harness)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

from kvbaton.cluster.deploy import DeploymentSpec, deploy
from kvbaton.config import CacheConfig, EngineConfig
from kvbaton.router.flight import Phase
from kvbaton.router.router import Router, RouterConfig
from kvbaton.router.worker_pool import PoolConfig
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.tokenizer import Tokenizer
from tests.support.wait import async_wait_until

POOL_FIELDS = {f.name for f in dataclasses.fields(PoolConfig)}


@contextlib.asynccontextmanager
async def router_over(model_dir, prefill: int, decode: int, transport: str = "shm", block_size: int = 4,
                      redis_url: str | None = None, log_dir=None, encrypt_traffic: bool = False,
                      engine_overrides: dict | None = None, **router_kwargs):
    """A real router over real worker processes (tiny fp32 model unless `engine_overrides` says
    otherwise), brought up by `deploy` as `kvbaton serve` does; everything stopped after. Keyword
    arguments go to the pool's or the router's config, by name."""
    engine = EngineConfig(model=str(model_dir), dtype="float32", num_threads=1,
                          cache=CacheConfig(block_size=block_size, num_blocks=256))
    engine = dataclasses.replace(engine, **(engine_overrides or {}))
    pool_kwargs = {k: v for k, v in router_kwargs.items() if k in POOL_FIELDS}
    pool = PoolConfig(**{"heartbeat_s": 0.2, "dead_after_s": 2.0, "start_timeout_s": 120.0, **pool_kwargs})
    config = RouterConfig(**{k: v for k, v in router_kwargs.items() if k not in POOL_FIELDS})
    spec = DeploymentSpec(num_prefill=prefill, num_decode=decode, kv_transport=transport, redis_url=redis_url,
                          allow_insecure_kv_transport=transport == "mooncake", router=config, pool=pool,
                          log_dir=log_dir, encrypt_traffic=encrypt_traffic)
    deployment = await deploy(engine, Tokenizer(model_dir), spec)
    try:
        yield deployment.router
        await assert_pools_clean(deployment.router)
    finally:
        await deployment.shutdown()


async def assert_pools_clean(router: Router, wait_s: float = 5.0) -> None:
    """Every surviving worker's KV pool passes its integrity check and holds nothing (bounded wait:
    a worker may still be releasing an aborted transfer)."""
    dirty: dict = {}

    async def clean() -> bool:
        nonlocal dirty
        reports = await router.check_workers()
        dirty = {name: r for name, r in reports.items() if r.error or r.num_requests or r.kv_cache_usage}
        return not dirty

    await async_wait_until(clean, wait_s, interval_s=0.2,
                           message=lambda: f"workers not clean after the scenario: {dirty}")


async def collect(router: Router, request_id: str, prompt: list[int], max_tokens: int, on_token=None) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    async for out in router.generate(request_id, None, prompt, params):
        tokens = list(out.outputs[0].token_ids)
        if on_token is not None:
            await on_token(request_id, len(tokens))
    return tokens


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def kill_when(router: Router, name: str, phase: Phase, min_tokens: int, timeout_s: float = 60.0) -> float:
    """SIGKILL `name` once a flight on it is in `phase` with at least `min_tokens` streamed; the kill time."""

    def reached() -> bool:
        on_it = [f for f in router.flights.values() if name in (f.prefill, f.decode) and f.phase == phase]
        return any(len(f.tokens) >= min_tokens for f in on_it)

    # a short polling pause: the kill must land while the flight is still in `phase`
    await async_wait_until(reached, timeout_s, interval_s=0.002, message=f"no flight on {name} reached {phase.value}")
    os.kill(router.pool.workers[name].pid, signal.SIGKILL)
    return time.monotonic()
