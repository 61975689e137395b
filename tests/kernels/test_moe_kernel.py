"""The MoE routed-experts kernel (moe_experts.c) against PyTorch on the same bf16 weights, on each instruction
set this CPU runs (and the AVX2 one built for Haswell, as an AVX2-only CPU builds it); thread-count
independence; batch invariance where promised; and the engine with the kernel against its PyTorch loop."""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvbaton.kernels.moe as moe
from kvbaton import LLM, SamplingParams
from kvbaton.config import MoEConfig
from kvbaton.kernels import cpu_kernels
from kvbaton.kernels.build import SIGNATURES
from kvbaton.kernels.linear import amx_enabled
from kvbaton.kernels.moe import (
    ISA_AMX,
    ISA_AVX2,
    ISA_AVX512_BF16,
    MoEExpertsKernel,
    moe_experts_kernel,
    moe_route_kernel,
)
from kvbaton.layers.compute_paths import MOE_KERNEL_ENV
from kvbaton.layers.moe.experts import ExpertGroups, GroupedExperts
from kvbaton.layers.moe.gate import TopKGate
from kvbaton.platform.cpu import detect_cpu
from tests.support.helpers import TINY_VOCAB

# NOTE: no skip: CI machines have gcc, so a kernel that fails to build must fail here.
assert cpu_kernels() is not None, "kvbaton's C kernels did not build (is a C compiler installed?)"

CPU = detect_cpu()
HAS_AMX = CPU.amx_bf16 and CPU.avx512_bf16 and amx_enabled()
# (instruction set, amx_min_rows): AMX with tiles for every row count, the dot tile for every count, and mixed
ISAS = [
    pytest.param(ISA_AVX2, 1, id="avx2", marks=pytest.mark.skipif(not CPU.avx2, reason="no AVX2/FMA")),
    pytest.param(ISA_AVX512_BF16, 1, id="avx512bf16",
                 marks=pytest.mark.skipif(not CPU.avx512_bf16, reason="this CPU has no AVX512-BF16")),
    *[pytest.param(ISA_AMX, rows, id=f"amx-min{rows}",
                   marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 (or the OS does not grant it)"))
      for rows in (1, 4)],
]
E, H, INTER, K = 16, 128, 96, 4  # INTER = 96: three 32-column AMX K tiles in the down projection


def stacked_weights(seed: int, experts: int = E, hidden: int = H, inter: int = INTER) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter) / inter**0.5).bfloat16()
    return gate_up, down


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """fp32 sums with PyTorch's bf16 roundings of gate, up, silu and their product; fp32 combine."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1])
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero().flatten()
            gate, up = F.linear(x[rows].float(), gate_up[e].float()).bfloat16().split(inter, dim=-1)
            act = F.silu(gate) * up
            out[rows] += weights[rows, j, None] * F.linear(act.float(), down[e].float())
    return out


def routing(tokens: int, hit: int, seed: int, k: int = K, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token among the first `hit` ones (the rest get no tokens), uneven when `skew`."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.ones(hit) if not skew else torch.linspace(1.0, 20.0, hit) ** 2
    ids = torch.stack([torch.multinomial(probs, min(k, hit), generator=gen) for _ in range(tokens)])
    weights = torch.rand(tokens, ids.shape[1], generator=gen)
    return ids, weights / weights.sum(dim=1, keepdim=True)


def packed(kernel: MoEExpertsKernel, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, d = gate_up.clone(), down.clone()
    kernel.pack_(g, d)
    return g, d


def close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    # NOTE: the kernel sums in another order than PyTorch, so a bf16 rounding of gate or up (and the output's)
    # may land one step away: errors of a few bf16 ulps of the output's scale.
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * max(1.0, float(ref.abs().max())), rtol=2**-6)


@pytest.mark.parametrize("isa, amx_min_rows", ISAS)
@pytest.mark.parametrize("tokens", [1, 3, 32, 200])
@pytest.mark.parametrize("hit, skew", [(1, False), (3, False), (9, True), (E, False), (E, True)])
def test_kernel_matches_pytorch(isa, amx_min_rows, tokens, hit, skew):
    """Row counts 1 to 200, 1 to all experts hit (experts past `hit` get no tokens), even and uneven counts."""
    kernel = moe_experts_kernel(isa, amx_min_rows)
    gate_up, down = stacked_weights(tokens + hit)
    ids, weights = routing(tokens, hit, seed=tokens * 100 + hit, skew=skew)
    x = torch.randn(tokens, H).bfloat16()
    g, d = packed(kernel, gate_up, down)
    out = kernel(x, ids, weights, g, d)
    close_to_reference(out, reference(x, ids, weights, gate_up, down))


@pytest.mark.parametrize("isa, amx_min_rows", ISAS)
def test_kernel_matches_the_pytorch_module(isa, amx_min_rows):
    """Through GroupedExperts: the PyTorch loop before `use_kernel`, the kernel after, on the same weights."""
    gate_up, down = stacked_weights(5)
    module = GroupedExperts(E, H, INTER).bfloat16().requires_grad_(False)
    module.gate_up_proj.copy_(gate_up)
    module.down_proj.copy_(down)
    ids, weights = routing(40, E, seed=5, skew=True)
    x = torch.randn(40, H).bfloat16()
    groups = ExpertGroups.of(ids, weights, E)
    expected = module(x, groups)
    storage = module.gate_up_proj.data_ptr(), module.down_proj.data_ptr()
    module.use_kernel(moe_experts_kernel(isa, amx_min_rows))
    assert (module.gate_up_proj.data_ptr(), module.down_proj.data_ptr()) == storage  # packed in place
    assert not torch.equal(module.gate_up_proj, gate_up)  # ... so the PyTorch loop could no longer read them
    got = module(x, groups)
    # NOTE: PyTorch's loop rounds each expert's output, its weighted value and every partial sum to bf16
    torch.testing.assert_close(got.float(), expected.float(), atol=6e-2, rtol=2**-5)
    with pytest.raises(RuntimeError):
        module.use_kernel(moe_experts_kernel(isa, amx_min_rows))
    assert module(x[:0], ExpertGroups.of(ids[:0], weights[:0], E)).shape == (0, H)


@pytest.mark.parametrize("isa, amx_min_rows", ISAS)
def test_thread_count_does_not_change_the_output(isa, amx_min_rows):
    kernel = moe_experts_kernel(isa, amx_min_rows)
    g, d = packed(kernel, *stacked_weights(9))
    for tokens, hit in ((1, E), (7, 5), (200, E)):
        ids, weights = routing(tokens, hit, seed=tokens, skew=True)
        x = torch.randn(tokens, H).bfloat16()
        kernel.num_threads = 2
        two = kernel(x, ids, weights, g, d)
        kernel.num_threads = 1
        assert torch.equal(kernel(x, ids, weights, g, d), two)
        kernel.num_threads = 3
        assert torch.equal(kernel(x, ids, weights, g, d), two)


@pytest.mark.parametrize("isa, amx_min_rows", [p for p in ISAS if p.values[1] == 1])
def test_batch_invariant_where_promised(isa, amx_min_rows):
    """AVX2, AVX512-BF16 and AMX with tiles for every row count: a token's output does not depend on the
    tokens beside it (what deterministic mode relies on)."""
    kernel = moe_experts_kernel(isa, amx_min_rows)
    g, d = packed(kernel, *stacked_weights(11))
    ids, weights = routing(50, 6, seed=11, skew=True)
    x = torch.randn(50, H).bfloat16()
    full = kernel(x, ids, weights, g, d)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 20), slice(17, 50)):
        assert torch.equal(kernel(x[rows], ids[rows], weights[rows], g, d), full[rows])


@pytest.mark.parametrize("isa", [p.values[0] for p in ISAS[:2]] if CPU.avx512_bf16 else [ISA_AVX2])
@pytest.mark.parametrize("experts, k, renormalize", [(64, 8, True), (8, 2, False), (60, 4, True)])
def test_gate_kernel_matches_the_softmax_router(isa, experts, k, renormalize):
    """Logits, softmax, top-k (and renormalization) in one call: the same choices as TopKGate's PyTorch path
    for every token whose k-th and next probabilities are apart (the two round the logits' sums differently),
    weights within a bf16 step of the logits."""
    torch.manual_seed(experts + k)
    moe_cfg = MoEConfig(num_experts=experts, top_k=k, intermediate_size=32, norm_topk_prob=renormalize)
    router = TopKGate(H, moe_cfg).bfloat16().requires_grad_(False)
    router.weight.normal_(0, 0.1)
    x = torch.randn(300, H).bfloat16()
    expected_w, expected_ids = router(x)
    kernel = moe_route_kernel(isa, max_rows=None)
    assert kernel.supports(router.weight)
    router.kernel = kernel
    got_w, got_ids = router(x)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32 and got_ids.shape == (300, k)
    probs = torch.softmax(F.linear(x, router.weight).float(), dim=-1).sort(dim=-1, descending=True).values
    apart = probs[:, k - 1] - probs[:, k] > 1e-2 * probs[:, 0]  # the k chosen are the same set in both
    assert apart.float().mean() > 0.5
    assert (got_w[:, :-1] >= got_w[:, 1:]).all()  # descending, as torch.topk returns them
    got_ids, order = got_ids.sort(dim=1)
    expected_ids, expected_order = expected_ids.sort(dim=1)
    assert torch.equal(got_ids[apart], expected_ids[apart])
    torch.testing.assert_close(got_w.gather(1, order)[apart], expected_w.gather(1, expected_order)[apart],
                               atol=1e-3, rtol=2e-2)
    batch_w, batch_ids = kernel(x, router.weight, k, renormalize)
    one_w, one_ids = kernel(x[5:6], router.weight, k, renormalize)  # per token: batch-invariant
    assert torch.equal(one_w, batch_w[5:6]) and torch.equal(one_ids, batch_ids[5:6])


def test_refuses_what_it_cannot_take():
    kernel = moe_experts_kernel(ISA_AVX2)
    assert not kernel.supports(*stacked_weights(0, inter=12))  # intermediate not a multiple of 8
    assert not kernel.supports(torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))  # fp32
    if CPU.avx512_bf16:
        tiles = moe_experts_kernel(ISA_AVX512_BF16)
        assert not tiles.supports(*stacked_weights(0, inter=48))  # down's K not a multiple of 32
        assert kernel.supports(*stacked_weights(0, inter=48))  # the AVX2 panels take it
    g, d = packed(kernel, *stacked_weights(0))
    with pytest.raises(ValueError, match="expert id"):
        kernel(torch.zeros(1, H).bfloat16(), torch.tensor([[E]]), torch.ones(1, 1), g, d)


@pytest.fixture(scope="module")
def haswell_lib(tmp_path_factory) -> ctypes.CDLL:
    """moe_experts.c built the way an AVX2-only CPU builds it (-march=haswell: no AVX-512 outside the
    functions compiled for it), then run on this CPU through its AVX2 instruction set."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    src = Path(moe.__file__).with_name("moe_experts.c")
    out = tmp_path_factory.mktemp("haswell") / "libmoe_haswell.so"
    obj = out.with_suffix(".o")
    # NOTE: compiled with the build's flags but, as build.py does, linked without -ffast-math: linking with it
    # pulls in crtfastmath.o, which turns on flush-to-zero for this whole test process once loaded
    subprocess.run([compiler, "-O3", "-march=haswell", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-c",
                    "-o", str(obj), str(src)], check=True, capture_output=True, text=True)
    subprocess.run([compiler, "-fopenmp", "-shared", "-o", str(out), str(obj), "-lm"], check=True,
                   capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    restype, argtypes = SIGNATURES["kvbaton_moe_experts"]
    lib.kvbaton_moe_experts.restype, lib.kvbaton_moe_experts.argtypes = restype, argtypes
    return lib


@pytest.mark.skipif(not CPU.avx2, reason="no AVX2/FMA")
@pytest.mark.parametrize("tokens", [1, 3, 32, 200])
def test_haswell_build_matches_pytorch(haswell_lib, tokens):
    kernel = MoEExpertsKernel(haswell_lib, 2, ISA_AVX2)
    gate_up, down = stacked_weights(tokens)
    ids, weights = routing(tokens, 11, seed=tokens, skew=True)
    x = torch.randn(tokens, H).bfloat16()
    g, d = packed(kernel, gate_up, down)
    out = kernel(x, ids, weights, g, d)
    close_to_reference(out, reference(x, ids, weights, gate_up, down))
    kernel.num_threads = 1
    assert torch.equal(kernel(x, ids, weights, g, d), out)


def _moe_blocks_kernels(llm: LLM) -> list[MoEExpertsKernel | None]:
    return [m.kernel for m in llm.engine.core.runner.model.modules() if isinstance(m, GroupedExperts)]


@pytest.mark.parametrize("path", [
    pytest.param("auto", id="this-cpu"),
    pytest.param("avx2", id="avx2", marks=pytest.mark.skipif(not CPU.avx2, reason="no AVX2/FMA"))])
def test_bf16_engine_experts_agree_with_pytorch_loop(tiny_moe_models, monkeypatch, path):
    """The tiny Qwen3-MoE in bf16 with the kernel on this CPU's row (and the AVX2 row): every MoE layer's
    output in prefill chunks and decode batches, recomputed by PyTorch's loop (an engine with
    KVBATON_MOE_KERNEL=0, unpacked weights) on the same inputs, agrees within the loop's bf16 roundings.
    NOTE: not greedy tokens: this random tiny model's top tokens are often within bf16 noise of each other,
    and a flipped routing choice amplifies that."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in (1, 9, 40, 70)]
    engines = {}
    for kernel in (True, False):
        monkeypatch.setenv(MOE_KERNEL_ENV, "1" if kernel else "0")
        engines[kernel] = LLM(str(tiny_moe_models["qwen3_moe"]), dtype="bfloat16", block_size=8,
                              compute_path=path, max_num_batched_tokens=32)
        kernels = _moe_blocks_kernels(engines[kernel])
        assert kernels and all((k is not None) == kernel for k in kernels)
    seen = []
    # decode steps through the Python loop, where the hooks see them (the C layer loop calls the same kernel:
    # tests/models/test_layer_loop.py checks it gives the Python loop's bits)
    engines[True].engine.core.runner.model.layer_loop = None
    layers = [m for m in engines[True].engine.core.runner.model.modules() if isinstance(m, GroupedExperts)]
    loops = [m for m in engines[False].engine.core.runner.model.modules() if isinstance(m, GroupedExperts)]
    for layer, loop in zip(layers, loops):
        layer.register_forward_hook(lambda mod, args, out, loop=loop: seen.append((loop, args[0], args[1], out)))
    engines[True].generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert {x.shape[0] for _, x, _, _ in seen} >= {1, 4, 32}  # decode batches and 32-token chunks
    for loop, x, groups, out in seen:
        expected = loop(x, ExpertGroups.of(groups.ids, groups.choice_weights, loop.num_experts))
        torch.testing.assert_close(out.float(), expected.float(), atol=6e-2, rtol=2**-5)


def test_fp32_engine_keeps_the_pytorch_loop(tiny_moe_models):
    llm = LLM(str(tiny_moe_models["qwen3_moe"]), dtype="float32", block_size=8)
    kernels = _moe_blocks_kernels(llm)
    assert kernels and all(k is None for k in kernels)


@pytest.mark.parametrize("path", sorted({"auto", "avx2"} if CPU.avx2 else {"auto"}))
def test_deterministic_moe_output_is_independent_of_batching(tiny_moe_models, path):
    """--deterministic with the MoE kernels (the gate for every row count, AMX tiles for every expert): a
    request's greedy output is the same alone, in a batch of 8 and prefilled in chunks on one thread."""
    from tests.support.helpers import deterministic_prompts, greedy

    model = str(tiny_moe_models["qwen3_moe"])
    llm = LLM(model, dtype="bfloat16", deterministic=True, num_threads=2, compute_path=path, block_size=8)
    kernels = _moe_blocks_kernels(llm)
    assert kernels and all(k is not None and k.amx_min_rows == 1 for k in kernels)
    prompts = deterministic_prompts(TINY_VOCAB, 8, seed=3)
    alone = [greedy(llm, 8, [p])[0] for p in prompts]
    assert greedy(llm, 8, prompts) == alone
    chunked = LLM(model, dtype="bfloat16", deterministic=True, num_threads=1, compute_path=path, block_size=8,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
    assert greedy(chunked, 8, prompts) == alone
