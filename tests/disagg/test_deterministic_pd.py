"""`--deterministic` across placements, on the real default model in bf16: 1 prefill + 2 decode
workers (separate processes, one thread each, KV handed over shared memory) produce the very tokens
the colocated in-process engine (two threads) produces; so do requests whose decode worker is
SIGKILLed mid-stream and which finish after a re-prefill of prompt + generated tokens elsewhere."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton import LLM
from kvbaton.config import CacheConfig
from kvbaton.router.flight import Phase
from tests.support.helpers import deterministic_prompts, greedy
from tests.support.pd import collect, kill_when, router_over, run
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.slow

MAX_NEW = 24

ENGINE = {"dtype": "bfloat16", "deterministic": True, "cache": CacheConfig(block_size=16, num_blocks=256)}


def test_pd_and_failover_match_colocated_token_for_token(default_model_dir):
    colocated = LLM(str(default_model_dir), dtype="bfloat16", deterministic=True)
    prompts = deterministic_prompts(colocated.engine.model_config.vocab_size, 16, seed=23)
    refs = greedy(colocated, MAX_NEW, prompts)
    del colocated

    async def scenario() -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
        async with router_over(default_model_dir, prefill=1, decode=2, engine_overrides=ENGINE,
                               local_prefill_threshold=0, decode_policy="round_robin", dead_after_s=2.0,
                               max_failed_attempts=3) as router:
            pd = await asyncio.gather(*(collect(router, f"pd{i}", p, MAX_NEW) for i, p in enumerate(prompts[:8])))
            tasks = [asyncio.create_task(collect(router, f"kill{i}", p, MAX_NEW))
                     for i, p in enumerate(prompts[8:])]
            await kill_when(router, "kvbaton-decode-1", Phase.DECODING, 3)
            after = await asyncio.gather(*tasks)
            # its replacement is launched (not waited for: the pool's shutdown stops a start in progress)
            supervisor = router.pool.supervisor
            await async_wait_until(lambda: supervisor.restarts("kvbaton-decode-1") == 1, 30.0, interval_s=0.05,
                                   message="kvbaton-decode-1 was not replaced")
            return pd, after, {"kvbaton-decode-1": supervisor.restarts("kvbaton-decode-1")}

    pd, after, restarts = run(scenario())
    assert pd == refs[:8]
    assert after == refs[8:]
    assert restarts["kvbaton-decode-1"] == 1
