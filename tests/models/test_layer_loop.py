"""The C layer loop of decode steps (kvbaton.models.layer_loop): it runs the steps it takes, gives the same bits as
the Python loop on every compute path this machine can run (so a token never depends on which loop ran its step),
and leaves every model and step it does not describe to the Python loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.config import ConfigError
from kvbaton.kernels.linear import amx_enabled
from kvbaton.layers.attention import AttentionMetadata
from kvbaton.models.layer_loop import LAYER_LOOP_ENV, LayerLoop
from kvbaton.platform.compute import choose_compute_plan
from kvbaton.platform.cpu import detect_cpu
from tests.support.helpers import TINY_POOL_GB, build_tiny_moe_checkpoint, tiny_prompts

PATHS = [pytest.param(p, d, id=p + ("-deterministic" if d else "")) for p in ("amx", "avx512-bf16", "avx2")
         for d in (False, True)]


class CountingLoop:
    """The model's own loop, counting the steps it took (and their rows)."""

    def __init__(self, loop: LayerLoop) -> None:
        self.loop = loop
        self.steps: list[int] = []
        self.with_head: list[int] = []  # the steps whose logits came out of the loop too
        self.has_head = loop.has_head

    def runs(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor], rows: int) -> bool:
        return self.loop.runs(meta, kv_caches, rows)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.steps.append(x.shape[0])
        return self.loop(x, positions, meta)

    def logits(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.steps.append(x.shape[0])
        self.with_head.append(x.shape[0])
        return self.loop.logits(x, positions, meta)


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p, "prompt": None} for p in prompts], params)
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outs]


def engine_with_counted_loop(model_dir: Path, path: str, deterministic: bool,
                             ) -> tuple[LLM, torch.nn.Module, CountingLoop]:
    """A bf16 engine on a compute path (skipped where this CPU cannot run it) whose C loop counts its steps."""
    try:
        choose_compute_plan(detect_cpu(), "bfloat16", path, deterministic, amx_granted=amx_enabled())
    except ConfigError as exc:
        pytest.skip(f"this CPU cannot run it: {exc}")
    # NOTE: no prefix caching: the second run's prompts would reuse the first's blocks, and a prompt step over a
    # cached prefix attends differently (SDPA over a masked context) from a whole prompt's
    llm = LLM(str(model_dir), dtype="bfloat16", block_size=8, kv_cache_memory_gb=TINY_POOL_GB, compute_path=path,
              deterministic=deterministic, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    assert isinstance(model.layer_loop, LayerLoop), "the C loop takes this model"
    counting = CountingLoop(model.layer_loop)
    model.layer_loop = counting
    return llm, model, counting


@pytest.mark.parametrize("path, deterministic", PATHS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "qwen3"])  # untied; q/k/v biases, tied; Llama-3 RoPE;
# per-head q/k norms
def test_the_c_loop_gives_the_python_loops_bits(tiny_models, arch, path, deterministic):
    llm, model, counting = engine_with_counted_loop(tiny_models[arch], path, deterministic)
    # decode batches of 16 rows (the most the avx512-bf16 row's dot kernel takes), then fewer as requests finish
    prompts = tiny_prompts(3, [9, 30, 17, *range(4, 30, 2)])
    with_loop = generate(llm, prompts)
    assert counting.steps, "no step ran the C loop"
    assert counting.has_head and counting.with_head, "no step's logits came out of the C loop"
    if deterministic:  # a prompt step samples one row of many: the loop stops at the last layer, Python goes on
        assert len(counting.with_head) < len(counting.steps)
    if path == "avx512-bf16" and not deterministic:  # its dot kernel takes up to 16 rows, so the loop does
        assert max(counting.steps) == len(prompts) == llm.engine.core.compute_plan.few_rows
    if deterministic:  # every token attends as a decode query: prompt steps run the loop too
        assert max(counting.steps) > len(prompts)
    model.layer_loop = None
    assert generate(llm, prompts) == with_loop


def tiny_llama_with_loop(tiny_models) -> tuple[LLM, torch.nn.Module, LayerLoop]:
    """A bf16 tiny Llama on this machine's default compute path, whose every row builds the C loop."""
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", block_size=8, kv_cache_memory_gb=TINY_POOL_GB)
    model = llm.engine.core.runner.model
    assert isinstance(model.layer_loop, LayerLoop), "every compute path's default plan builds the C loop"
    return llm, model, model.layer_loop


def test_steps_it_does_not_take_run_the_python_loop(tiny_models):
    llm, model, loop = tiny_llama_with_loop(tiny_models)
    counting = CountingLoop(loop)
    model.layer_loop = counting
    generate(llm, tiny_prompts(5, [20]))
    # the prompt step (a prefill) ran in Python: every step the loop took was one decode row
    assert counting.steps and set(counting.steps) == {1}
    many = llm.engine.core.compute_plan.few_rows + 1  # avx512-bf16: oneDNN computes 17 rows, so Python does
    assert loop.layers.takes(many) == (llm.engine.core.compute_plan.path != "avx512-bf16")


@pytest.mark.parametrize("case", ["fp32", "int8-kv", "env"])
def test_models_it_does_not_describe_keep_the_python_loop(tiny_models, monkeypatch, case):
    kwargs: dict = {"dtype": "bfloat16", "block_size": 8, "kv_cache_memory_gb": TINY_POOL_GB}
    arch = "llama"
    if case == "fp32":
        kwargs["dtype"] = "float32"
    elif case == "int8-kv":
        kwargs["kv_cache_dtype"] = "int8"
    else:
        monkeypatch.setenv(LAYER_LOOP_ENV, "0")
    llm = LLM(str(tiny_models[arch]), **kwargs)
    assert llm.engine.core.runner.model.layer_loop is None
    outputs = generate(llm, tiny_prompts(7, [11]))
    assert len(outputs[0][0]) == 12


@pytest.fixture(scope="module")
def loop_moe_models(tiny_moe_models, tmp_path_factory) -> dict[str, Path]:
    """MoE models whose experts the C experts kernel takes on every instruction set (intermediate % 32 == 0): a
    tiny Mixtral of intermediate 64 and the tiny Qwen3-MoE (per-head q/k norms, norm_topk_prob)."""
    mixtral = build_tiny_moe_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral-64"), intermediate_size=64)
    return {"mixtral": mixtral, "qwen3_moe": tiny_moe_models["qwen3_moe"]}


def expert_totals(llm: LLM) -> torch.Tensor:
    stats = llm.engine.core.expert_stats
    assert stats is not None
    return torch.tensor(stats.window.totals())


@pytest.mark.parametrize("path, deterministic", PATHS)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_layers_run_in_the_c_loop_with_the_python_loops_bits(loop_moe_models, arch, path, deterministic):
    llm, model, counting = engine_with_counted_loop(loop_moe_models[arch], path, deterministic)
    prompts = tiny_prompts(4, [9, 30, 17, 5, 12])
    before = expert_totals(llm)
    with_loop = generate(llm, prompts)
    routed_in_loop = expert_totals(llm) - before
    assert counting.steps and counting.with_head, "no step ran the C loop"
    model.layer_loop = None
    assert generate(llm, prompts) == with_loop
    # the loop counted each expert's tokens as the Python block does (the load EPLB and /experts read)
    assert torch.equal(expert_totals(llm) - before - routed_in_loop, routed_in_loop)
    assert routed_in_loop.sum() == 2 * sum(len(p) + 11 for p in prompts) * routed_in_loop.shape[0]  # top-2, 3 layers


def test_moe_models_it_does_not_describe_keep_the_python_loop(tiny_moe_models):
    # Qwen2-MoE: a gated shared expert; OLMoE: whole-q/k norms and clip_qkv; the tiny Mixtral: intermediate 48,
    # which the tile-layout experts kernels refuse (the avx2 one takes it)
    for arch in ("qwen2_moe", "olmoe", "mixtral"):
        llm = LLM(str(tiny_moe_models[arch]), dtype="bfloat16", block_size=8, kv_cache_memory_gb=TINY_POOL_GB)
        loop = llm.engine.core.runner.model.layer_loop
        assert loop is None or (arch == "mixtral" and llm.engine.core.compute_plan.path == "avx2")


def test_a_step_out_of_bounds_is_refused_before_anything_is_written(tiny_models):
    _, model, loop = tiny_llama_with_loop(tiny_models)
    layers, pools = loop.layers, loop.kv_caches
    before = [p.clone() for p in pools]
    for position, slot, what in ((layers.stack.max_positions, 3, "RoPE table"), (3, layers.stack.num_slots, "KV pool")):
        x = model.embed_tokens(torch.tensor([5]))
        with pytest.raises(IndexError, match=what):
            layers(x, torch.tensor([position]), torch.tensor([slot]), torch.tensor([[0]]), torch.tensor([4]),
                   logits=True)
    assert all(torch.equal(a, b) for a, b in zip(before, pools))
