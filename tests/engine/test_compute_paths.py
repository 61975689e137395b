"""Every compute path this machine can run, end to end: the engine takes the table's row for this CPU
and sets its layers up as the row says; fp32 greedy output is token-identical to transformers on every
path; bf16 next-token log-probabilities stay within a stated tolerance of kvbaton's own fp32.

A path this CPU cannot run is skipped with the reason (e.g. avx512-bf16 on an AVX2-only CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.config import ConfigError
from kvbaton.kernels.linear import ISA_AVX512_BF16, AMXLinear, DotLinear, SmallBatchLinear, amx_enabled
from kvbaton.layers.linear import Linear
from kvbaton.platform.compute import COMPUTE_PATHS, ComputePlan, choose_compute_plan
from kvbaton.platform.cpu import detect_cpu
from tests.support.helpers import TINY_VOCAB, hf_greedy

# (path, deterministic): every row of the table, and the deterministic variant of this CPU's own row
VARIANTS = [pytest.param(p, False, id=p) for p in COMPUTE_PATHS if p != "auto"] + [
    pytest.param(p, True, id=f"{p}-deterministic") for p in COMPUTE_PATHS if p not in ("auto", "onednn", "torch")]
# bf16 vs fp32 on the real default model: next-token log-probabilities of the top 10 tokens
BF16_LOGPROB_TOLERANCE = 0.25  # measured worst: 0.16 (avx512-bf16, Xeon)


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in lengths]


def runnable_here(path: str, deterministic: bool, dtype: str) -> ComputePlan:
    try:
        return choose_compute_plan(detect_cpu(), dtype, path, deterministic, amx_granted=amx_enabled())
    except ConfigError as exc:
        pytest.skip(f"this CPU cannot run it: {exc}")


def assert_model_follows(model: torch.nn.Module, plan: ComputePlan) -> None:
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    mlps = [layer.mlp for layer in model.layers]
    few = {"stream-avx2": SmallBatchLinear, "dot-avx512bf16": DotLinear, "dot-generic": DotLinear}.get(
        plan.few_rows_linear)
    for linear in linears:
        assert (linear.rows_kernel is None) if few is None else isinstance(linear.rows_kernel, few)
        if isinstance(linear.rows_kernel, DotLinear):
            assert (linear.rows_kernel.isa == ISA_AVX512_BF16) == (plan.few_rows_linear == "dot-avx512bf16")
            assert (linear.rows_kernel.max_rows is None) == plan.deterministic
        fused = any(linear is m.gate_up_proj and m.fused_gate_up is not None for m in mlps)
        assert (linear.packed is not None or fused) == (plan.many_rows_linear == "packed")
        assert (linear.upcast_min_rows is not None) == (plan.many_rows_linear == "torch-fp32")
        assert isinstance(linear.tile_kernel, AMXLinear) == (plan.many_rows_linear == "amx")  # K % 32 == 0 here
    assert (model.norm.kernel is not None) == (plan.norm == "c")


def test_engine_takes_this_cpus_row(tiny_models):
    engine = LLM(str(tiny_models["llama"]), dtype="bfloat16", block_size=8).engine
    plan = engine.core.compute_plan
    assert plan == choose_compute_plan(detect_cpu(), "bfloat16", amx_granted=amx_enabled())
    cpu = detect_cpu()
    native = "amx" if cpu.amx_bf16 and amx_enabled() else "avx512-bf16"
    expected = native if cpu.avx512_bf16 else "avx2" if cpu.avx2 else "onednn"
    assert plan.path == expected
    assert_model_follows(engine.core.runner.model, plan)
    assert engine.info.compute_path == plan.summary()


@pytest.mark.parametrize("path, deterministic", VARIANTS)
def test_bf16_layers_follow_the_plan(tiny_models, path, deterministic):
    plan = runnable_here(path, deterministic, "bfloat16")
    engine = LLM(str(tiny_models["qwen2"]), dtype="bfloat16", block_size=8, compute_path=path,
                 deterministic=deterministic).engine
    assert engine.core.compute_plan == plan
    assert_model_follows(engine.core.runner.model, plan)
    runner = engine.core.runner
    assert (runner.decode_kernel is None) == (plan.attention == "torch")
    assert (runner.prefill_kernel is not None) == (plan.attention == "c")
    if runner.decode_kernel is not None:
        assert runner.decode_kernel.split_context == (plan.attention != "c-per-token")


@pytest.mark.parametrize("path, deterministic", VARIANTS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp32_greedy_matches_transformers_on_every_path(tiny_models, path, deterministic, arch):
    runnable_here(path, deterministic, "float32")
    prompts = random_prompts(len(arch), [9, 40, 3, 77])
    refs = hf_greedy(tiny_models[arch], prompts, 20)
    # a token budget of 32 chunks the longer prompts and batches decodes with prefill chunks
    llm = LLM(str(tiny_models[arch]), dtype="float32", block_size=4, max_num_batched_tokens=32,
              compute_path=path, deterministic=deterministic)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20))
    assert [o.outputs[0].token_ids for o in outs] == refs


@pytest.fixture(scope="module")
def fp32_logprobs(default_model_dir):
    """The prompts and fp32's first-token logprobs (the fp32 engine is dropped: one engine alive at a time)."""
    llm = LLM(str(default_model_dir), dtype="float32", kv_cache_memory_gb=0.25)
    prompts = default_prompts(llm)
    return prompts, first_logprobs(llm, prompts)


def default_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to ten."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]


def first_logprobs(llm: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, logprobs=10))
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("path, deterministic", VARIANTS)
def test_bf16_logprobs_within_tolerance_of_fp32(default_model_dir, fp32_logprobs, path, deterministic):
    runnable_here(path, deterministic, "bfloat16")
    prompts, reference = fp32_logprobs
    llm = LLM(str(default_model_dir), dtype="bfloat16", compute_path=path, deterministic=deterministic,
              kv_cache_memory_gb=0.25)
    got = first_logprobs(llm, prompts)
    worst = 0.0
    for ref, lps in zip(reference, got):
        top, runner_up = sorted(ref, key=ref.__getitem__)[::-1][:2]
        # The same greedy first token, where bf16 can tell: it rounds logits near 20 to steps of 0.125, so two
        # tokens fp32 puts closer than the tolerance may tie or swap (0.098 apart, tied on an EPYC's onednn row).
        # Then the fp32 favourite must still be bf16's best within the tolerance.
        if ref[top] - ref[runner_up] > 2 * BF16_LOGPROB_TOLERANCE:
            assert max(lps, key=lps.__getitem__) == top
        assert top in lps and max(lps.values()) - lps[top] < BF16_LOGPROB_TOLERANCE
        worst = max(worst, *(abs(lps[t] - ref[t]) for t in ref if t in lps))
        assert len(set(ref) & set(lps)) >= 7
    print(f"{path}{' deterministic' if deterministic else ''}: worst |bf16 - fp32| logprob {worst:.3f}")
    assert worst < BF16_LOGPROB_TOLERANCE
