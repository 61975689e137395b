"""Decode bursts (kvbaton.sched.burst): greedy decodes run several steps per scheduled step, in one C call where the
layer loop takes the rows, else step by step in Python; either way the tokens are those of single steps."""

from __future__ import annotations

import gc

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.config import ConfigError
from kvbaton.kernels.linear import amx_enabled
from kvbaton.models.layer_loop import LayerLoop
from kvbaton.platform.compute import choose_compute_plan
from kvbaton.platform.cpu import detect_cpu
from tests.models.test_layer_loop import PATHS
from tests.support.helpers import TINY_POOL_GB, tiny_prompts


class CountingBursts:
    """The model's own loop, counting the bursts it ran in C (their steps)."""

    def __init__(self, loop: LayerLoop) -> None:
        self.loop = loop
        self.bursts_run: list[int] = []
        self.has_head = loop.has_head
        self.runs, self.logits, self.bursts = loop.runs, loop.logits, loop.bursts

    def __call__(self, *args):
        return self.loop(*args)

    def burst(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
              steps: int) -> torch.Tensor:
        self.bursts_run.append(steps)
        return self.loop.burst(tokens, positions, block_table, steps)


def generate(llm: LLM, prompts: list[list[int]], **params) -> list[tuple[list[int], str]]:
    outs = llm.generate([{"prompt_token_ids": p, "prompt": None} for p in prompts],
                        SamplingParams(temperature=0.0, **params))
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("path, deterministic", PATHS)
def test_a_burst_gives_the_tokens_of_single_steps(tiny_models, path, deterministic):
    try:
        choose_compute_plan(detect_cpu(), "bfloat16", path, deterministic, amx_granted=amx_enabled())
    except ConfigError as exc:
        pytest.skip(f"this CPU cannot run it: {exc}")
    kwargs = {"dtype": "bfloat16", "block_size": 8, "kv_cache_memory_gb": TINY_POOL_GB, "compute_path": path,
              "deterministic": deterministic, "enable_prefix_caching": False}
    prompts = tiny_prompts(11, [9, 30, 17, 5])
    single = LLM(str(tiny_models["llama"]), decode_burst=1, **kwargs)
    want = generate(single, prompts, max_tokens=14, ignore_eos=True)
    # every stop a burst can meet: max_tokens inside it, a stop token (one the requests produce) and EOS
    stop = [want[1][0][5]]
    want_stops = generate(single, prompts, max_tokens=13, stop_token_ids=stop)
    single.engine.core.close()  # one engine at a time: the suite's workers run near their memory budget
    del single
    gc.collect()
    bursting = LLM(str(tiny_models["llama"]), decode_burst=4, **kwargs)
    model = bursting.engine.core.runner.model
    assert isinstance(model.layer_loop, LayerLoop)
    counting = CountingBursts(model.layer_loop)
    model.layer_loop = counting
    assert generate(bursting, prompts, max_tokens=14, ignore_eos=True) == want
    assert generate(bursting, prompts, max_tokens=13, stop_token_ids=stop) == want_stops
    assert counting.bursts_run and max(counting.bursts_run) == 4, "no burst ran in C"
    model.layer_loop = None  # the Python loop, step by step inside the burst
    assert generate(bursting, prompts, max_tokens=14, ignore_eos=True) == want


def test_a_burst_out_of_bounds_is_refused(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", block_size=8, kv_cache_memory_gb=TINY_POOL_GB)
    loop = llm.engine.core.runner.model.layer_loop
    assert isinstance(loop, LayerLoop)
    pools = [p.clone() for p in loop.kv_caches]
    vocab, max_positions = loop.embed.shape[0], loop.layers.stack.max_positions
    last_block = loop.layers.stack.num_slots // 8 - 1
    for tokens, positions, table, what in (([vocab], [3], [[0]], "embedding table"),
                                           ([5], [6], [[0]], "block table"),  # step 3 at 8 leaves block 0
                                           ([5], [0], [[-1]], "block table"),
                                           ([5], [6], [[last_block + 1]], "KV pool"),
                                           ([5], [max_positions - 2], [[0] * (max_positions // 8)], "RoPE")):
        with pytest.raises(IndexError, match=what):
            loop.burst(torch.tensor(tokens), torch.tensor(positions), torch.tensor(table), 3)
    assert all(torch.equal(a, b) for a, b in zip(pools, loop.kv_caches)), "a refused burst wrote the pools"
