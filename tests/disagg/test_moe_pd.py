"""Every sparse-expert family through 1 prefill + 1 decode worker (real processes, fp32): the KV computed
by the prefill worker's MoE model, moved over shm or tcp, decodes to transformers' greedy output."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run

MAX_NEW = 8


@pytest.mark.parametrize(("arch", "transport"), [("mixtral", "shm"), ("qwen2_moe", "tcp"), ("qwen3_moe", "tcp"),
                                                 ("olmoe", "shm")])
def test_moe_family_prefill_to_decode_matches_transformers(tiny_moe_models, arch, transport):
    model = tiny_moe_models[arch]
    prompts = tiny_prompts(17, [5, 23, 40])
    refs = hf_greedy(model, prompts, MAX_NEW)

    async def scenario():
        async with router_over(model, prefill=1, decode=1, transport=transport, local_prefill_threshold=0) as router:
            return await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)))

    assert run(scenario()) == refs
