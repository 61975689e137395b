"""Structured outputs across placements, on the real default model (`--deterministic` bf16, so token
identity is the oracle): with 1 prefill + 2 decode workers, the prefill worker's first token obeys the
grammar and the decode worker's matcher, rebuilt from the tokens it is handed, goes on exactly as the
colocated engine's; a request whose decode worker is SIGKILLed mid-stream resumes elsewhere from
prompt + its output so far, rebuilds its matcher from those tokens, and ends with the same valid JSON."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from kvbaton import LLM
from kvbaton.config import CacheConfig
from kvbaton.router.flight import Phase
from kvbaton.router.router import Router
from kvbaton.sched.grammar_spec import StructuredOutput
from kvbaton.sched.sampling_params import SamplingParams
from tests.support.pd import kill_when, router_over, run
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.slow

ENGINE = {"dtype": "bfloat16", "deterministic": True, "cache": CacheConfig(block_size=16, num_blocks=256)}
ITEM = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                   "price": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "maxItems": 3}},
    "required": ["name", "price", "tags"],
    "additionalProperties": False,
}
THINGS = ["a bicycle", "a coffee mug", "a laptop", "a pair of shoes", "a lamp", "a tent", "a guitar", "a book"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, structured_output=StructuredOutput.json_schema(ITEM))


async def _collect(router: Router, request_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in router.generate(request_id, None, prompt, PARAMS):
        tokens = list(out.outputs[0].token_ids)
    return tokens


def test_grammar_survives_pd_handoff_and_failover(default_model_dir):
    colocated = LLM(str(default_model_dir), dtype="bfloat16", deterministic=True)
    tok = colocated.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Describe {thing} for our shop as "
                                                    "JSON."}], tokenize=False, add_generation_prompt=True))
               for thing in THINGS]
    refs = [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]
    texts = [tok.decode(r, skip_special_tokens=True) for r in refs]
    del colocated
    for text in texts:
        jsonschema.validate(json.loads(text), ITEM)

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        async with router_over(default_model_dir, prefill=1, decode=2, engine_overrides=ENGINE,
                               local_prefill_threshold=0, decode_policy="round_robin", dead_after_s=2.0,
                               max_failed_attempts=3) as router:
            pd = await asyncio.gather(*(_collect(router, f"pd{i}", p) for i, p in enumerate(prompts[:4])))
            tasks = [asyncio.create_task(_collect(router, f"kill{i}", p)) for i, p in enumerate(prompts[4:])]
            await kill_when(router, "kvbaton-decode-1", Phase.DECODING, 4)
            after = await asyncio.gather(*tasks)
            # let the replacement join before everything stops
            await async_wait_until(lambda: "kvbaton-decode-1" in router.pool.workers, 90.0, interval_s=0.1,
                                   message="the replacement of kvbaton-decode-1 did not join")
            return pd, after

    pd, after = run(scenario())
    assert pd == refs[:4]
    assert after == refs[4:]
