"""kvbaton's C CPU kernels against plain fp32 PyTorch math on the same (bf16 or fp32) inputs,
and the engine with kernels on vs. the PyTorch-only path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvbaton import LLM, SamplingParams
from kvbaton.kernels import (
    add_rms_norm_kernel,
    cpu_kernels,
    pack_linear,
    paged_decode_kernel,
    paged_prefill_kernel,
    small_batch_linear,
)
from kvbaton.kernels.kv_quant import dequantize_rows, quantize_rows
from kvbaton.kernels.linear import amx_enabled, dot_linear, pack_amx
from kvbaton.platform.cpu import detect_cpu
from tests.support.helpers import TINY_VOCAB, hf_greedy

# NOTE: no skip: CI machines have gcc, so a kernel that fails to build must fail here.
assert cpu_kernels() is not None, "kvbaton's C kernels did not build (is a C compiler installed?)"


def reference_decode(q, pool, table, lens, block_size):
    """fp32 attention of each request's single query over its context, gathered slot by slot."""
    q, pool = q.float(), pool.float()
    num_heads, num_kv_heads = q.shape[1], pool.shape[2]
    out = []
    for b in range(q.shape[0]):
        slots = torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size
                              for p in range(int(lens[b]))])
        k = pool[slots, 0].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = pool[slots, 1].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * q.shape[-1] ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 32, 32)])
@pytest.mark.parametrize("lens", [[1], [1, 16, 17, 300], [40] * 9, [700, 5]])
def test_paged_decode_matches_fp32_reference(dtype, heads, kv_heads, head_dim, block_size, lens):
    torch.manual_seed(len(lens) * 7 + head_dim)
    nb = -(-max(lens) // block_size)
    num_blocks = len(lens) * nb + 3
    pool = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim).to(dtype)
    # Blocks in scrambled order, as a long-running pool hands them out; padding points at block 0.
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(lens), nb, dtype=torch.long)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        table[b, :used] = perm[b * nb: b * nb + used]
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    kernel = paged_decode_kernel(dtype, heads, kv_heads, head_dim)
    out = kernel(q, pool, table, torch.tensor(lens), block_size, head_dim**-0.5)
    ref = reference_decode(q, pool, table, lens, block_size)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 32, 32),
                                                                (12, 2, 96, 8)])
@pytest.mark.parametrize("lens", [[1], [1, 16, 17, 300], [700, 5]])
@pytest.mark.parametrize("q_kind", ["bf16-values", "fp32-values"])
def test_paged_decode_over_a_bf16_pool_is_fp32_exact(heads, kv_heads, head_dim, block_size, lens, q_kind):
    """A bf16 pool read with fp32 queries, checked in fp32: bf16-valued queries (a bf16 model's) take the
    AVX512-BF16 path where the CPU has it (bf16 pairs multiplied exactly), others the fp32 tiles'."""
    torch.manual_seed(len(lens) * 11 + head_dim)
    nb = -(-max(lens) // block_size)
    num_blocks = len(lens) * nb + 3
    pool = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim).bfloat16()
    table = torch.randperm(num_blocks)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), heads, head_dim)
    if q_kind == "bf16-values":
        q = q.bfloat16().float()
    kernel = paged_decode_kernel(torch.bfloat16, heads, kv_heads, head_dim)
    for split in (True, False):
        kernel.split_context = split
        out = kernel(q, pool, table, torch.tensor(lens), block_size, head_dim**-0.5)
        torch.testing.assert_close(out, reference_decode(q, pool.float(), table, lens, block_size), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_without_split_is_batch_invariant(pool_dtype):
    """split_context=False (deterministic serving): each query's output is bit-identical alone (a block table
    just wide enough for it), beside wider and narrower contexts, and on 1 or 2 threads. Contexts past 128 tokens
    are still split, at boundaries set by their own length (parts of 128, 256, 384... tokens, at most 8), so a
    batch-1 decode shares its attention across threads."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [1100, 5, 129, 128, 1000, 300, 2100]  # 1000: 8 parts of 128; 1100: 5 of 256; 2100: 6 of 384
    nb = -(-max(lens) // block_size)
    num_blocks = len(lens) * nb + 3
    pool = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim).to(pool_dtype)
    table = torch.randperm(num_blocks)[: len(lens) * nb].view(len(lens), nb).contiguous()
    q = torch.randn(len(lens), heads, head_dim).bfloat16().float()  # a bf16 model's: the AVX512-BF16 path
    kernel = paged_decode_kernel(pool_dtype, heads, kv_heads, head_dim, split_context=False)
    scale = head_dim**-0.5
    full = kernel(q, pool, table, torch.tensor(lens), block_size, scale)
    for b, n in enumerate(lens):
        own = table[b: b + 1, : -(-n // block_size)].contiguous()
        assert torch.equal(kernel(q[b: b + 1], pool, own, torch.tensor([n]), block_size, scale), full[b: b + 1])
    kernel.num_threads = 1
    assert torch.equal(kernel(q, pool, table, torch.tensor(lens), block_size, scale), full)
    torch.testing.assert_close(full, reference_decode(q, pool.float(), table, lens, block_size), atol=1e-5, rtol=1e-5)


def quantized_pool(storage, slots, kv_heads, head_dim):
    """Rows of every magnitude quantized as the engine writes them; for fp8, every fifth token's rows are
    random codes instead (every finite e4m3 value, subnormals included) with a scale of 1/448."""
    magnitudes = torch.logspace(-3, 1, slots)[torch.randperm(slots)]
    x = torch.randn(slots, 2, kv_heads, head_dim) * magnitudes[:, None, None, None]
    pool = quantize_rows(x, storage)
    if storage == torch.uint8:
        codes = torch.randint(0, 256, (slots // 5, 2, kv_heads, head_dim), dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are e4m3's NaNs: never written
        scale = torch.full((slots // 5, 2, kv_heads, 1), 1 / 448).view(torch.uint8)
        pool[::5][: slots // 5] = torch.cat([codes, scale], dim=-1)
    return pool


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8], ids=["int8", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 32, 32),
                                                                (7, 1, 48, 8), (4, 2, 24, 16)])
@pytest.mark.parametrize("lens", [[1], [1, 16, 17, 300], [700, 5]])
@pytest.mark.parametrize("split", [True, False], ids=["split", "no-split"])
def test_paged_decode_over_quantized_kv_matches_dequantized_reference(storage, heads, kv_heads, head_dim,
                                                                      block_size, lens, split):
    """int8 / fp8 pools are read as codes (scales folded into scores and probabilities, head_dim a multiple of
    16; 24 takes the dequantizing path): the output must be fp32 attention over the dequantized pool, up to
    fp32 rounding. Context lengths not multiples of the 16-token tile or of the block, batch > 1, and both the
    split (flash-decoding partitions) and the one-partition path."""
    torch.manual_seed(len(lens) * 11 + head_dim + block_size)
    nb = -(-max(lens) // block_size)
    num_blocks = len(lens) * nb + 3
    pool = quantized_pool(storage, num_blocks * block_size, kv_heads, head_dim)
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(lens), nb, dtype=torch.long)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        table[b, :used] = perm[b * nb: b * nb + used]
    q = torch.randn(len(lens), heads, head_dim)
    kernel = paged_decode_kernel(storage, heads, kv_heads, head_dim, split_context=split)
    out = kernel(q, pool, table, torch.tensor(lens), block_size, head_dim**-0.5)
    ref = reference_decode(q, dequantize_rows(pool, torch.float32), table, lens, block_size)
    assert out.dtype == torch.float32 and out.shape == q.shape
    scale = ref.abs().amax().clamp_min(1e-30)  # rows span 1e-3 .. 10: compare relative to the output's size
    torch.testing.assert_close(out / scale, ref / scale, atol=1e-5, rtol=1e-5)


def test_paged_decode_unsupported_shapes_fall_back():
    assert paged_decode_kernel(torch.float16, 8, 2, 64) is None
    assert paged_decode_kernel(torch.float32, 8, 2, 60) is None  # head_dim not a multiple of 8
    assert paged_decode_kernel(torch.float32, 128, 2, 64) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 4), (16, 1, 8, 8), (16, 2, 128, 8), (40, 1, 96, 16)])
@pytest.mark.parametrize(("start", "tokens"), [(0, 1), (0, 37), (13, 1), (13, 50), (64, 16)])
def test_paged_prefill_matches_fp32_reference(dtype, heads, kv_heads, head_dim, block_size, start, tokens):
    """A chunk of `tokens` queries at positions [start, start + tokens), causal over everything
    before it in the pool: from scratch, single tokens, and chunks after earlier context."""
    torch.manual_seed(start + tokens)
    context = start + tokens
    num_blocks = -(-context // block_size)
    pool = torch.randn(64 * block_size, 2, kv_heads, head_dim).to(dtype)
    blocks = torch.randperm(64)[:num_blocks].contiguous()  # scattered in the pool
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    out = paged_prefill_kernel(dtype, heads, kv_heads, head_dim)(q, pool, blocks, start, block_size, head_dim**-0.5)
    slots = torch.tensor([int(blocks[p // block_size]) * block_size + p % block_size for p in range(context)])
    k, v = (pool[slots, i].float().transpose(0, 1)[None] for i in (0, 1))  # [1, Hkv, L, D]
    visible = torch.arange(context)[None] <= torch.arange(start, context)[:, None]  # [T, L]
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k, v, attn_mask=visible,
                                         enable_gqa=True)[0].transpose(0, 1)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2,
                               rtol=1e-4 if dtype == torch.float32 else 1e-2)


DOT_ISAS = [pytest.param(False, id="generic"),
            pytest.param(True, id="avx512bf16", marks=pytest.mark.skipif(
                not detect_cpu().avx512_bf16, reason="this CPU has no AVX512-BF16 (vdpbf16ps)"))]


@pytest.mark.parametrize("avx512_bf16", DOT_ISAS)
@pytest.mark.parametrize("n, k, bias", [(100, 72, True), (3072, 576, False), (64, 200, False)])
def test_dot_linear_matches_fp32(avx512_bf16, n, k, bias):
    torch.manual_seed(n + k)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(13, k).bfloat16()
    b = torch.randn(n) if bias else None
    out = dot_linear(avx512_bf16, max_rows=None)(x, weight, b)
    ref = F.linear(x.float(), weight.float(), b)
    assert out.dtype == torch.bfloat16 and out.shape == (13, n)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * k**0.5, rtol=2**-7)


@pytest.mark.parametrize("avx512_bf16, weight_dtype", [(False, torch.float32)] + [
    pytest.param(p.values[0], torch.bfloat16, id=f"{p.id}-bf16", marks=p.marks) for p in DOT_ISAS])
@pytest.mark.parametrize("n, k", [(1000, 576), (103, 200)])  # K in whole 32-element chunks, and with a tail
def test_dot_linear_is_batch_invariant(avx512_bf16, weight_dtype, n, k):
    """Each output is bit-identical whatever the rows around it, their number or the thread count: up to 4 rows
    read the weights column by column, more go through the register tiles, and both sum alike."""
    torch.manual_seed(7)
    weight = torch.randn(n, k).to(weight_dtype)
    x = torch.randn(40, k).to(weight_dtype)
    kernel = dot_linear(avx512_bf16, max_rows=None)
    full = kernel(x, weight, None)
    for rows in (slice(0, 1), slice(5, 6), slice(10, 12), slice(3, 7), slice(3, 11), slice(1, 33), slice(39, 40)):
        assert torch.equal(kernel(x[rows], weight, None), full[rows])
    kernel.num_threads = 1
    assert torch.equal(kernel(x, weight, None), full)


needs_amx = pytest.mark.skipif(not (detect_cpu().amx_bf16 and amx_enabled()),
                               reason="this CPU has no AMX-BF16 (or the OS does not grant this process the AMX state)")


@needs_amx
@pytest.mark.parametrize("n, k, bias", [(100, 64, True), (3072, 576, False), (49152, 576, False)])
def test_amx_linear_matches_fp32_and_is_batch_invariant(n, k, bias):
    torch.manual_seed(n)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(37, k).bfloat16()
    b = torch.randn(n) if bias else None
    kernel = pack_amx(weight, b, max_rows=None)
    out = kernel(x)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), b), atol=2e-2 * k**0.5, rtol=2**-7)
    for rows in (slice(0, 1), slice(9, 10), slice(3, 20), slice(16, 37)):  # across 16-row tile boundaries
        assert torch.equal(kernel(x[rows]), out[rows])
    kernel.num_threads = 1
    assert torch.equal(kernel(x), out)


def test_amx_refuses_what_it_cannot_take():
    assert pack_amx(torch.randn(64, 72).bfloat16(), None, None) is None  # K not a multiple of 32
    assert pack_amx(torch.randn(64, 64), None, None) is None  # fp32


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_linear_matches_fp32(rows, bias):
    torch.manual_seed(rows)
    weight = torch.randn(100, 72).bfloat16()  # N not a multiple of anything in particular
    b = torch.randn(100).bfloat16() if bias else None
    x = torch.randn(rows, 72).bfloat16()
    kernel = small_batch_linear()
    assert kernel.handles(x, weight) and not kernel.handles(torch.randn(9, 72).bfloat16(), weight)
    out = kernel(x, weight, b)
    ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 100)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)
    # Leading dimensions are kept ([B, T, K] inputs).
    assert kernel(x.view(1, rows, 72), weight, b).shape == (1, rows, 100)


def test_engine_without_kernels_matches_transformers(tiny_models):
    """The PyTorch-only path (no compiler, or kernels=False) stays token-identical too."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in (1, 5, 17, 33)]
    llm = LLM(str(tiny_models["llama"]), dtype="float32", kernels=False, block_size=4)
    assert llm.engine.core.runner.decode_kernel is None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_models["llama"], prompts, 10)
    llm.engine.check_integrity()


def test_bf16_engine_kernels_agree_with_pytorch_path(tiny_models):
    """bf16 decode through the C kernels and through PyTorch ops: same greedy tokens here,
    and per-step logprobs of the chosen tokens within bf16 noise."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in (3, 20, 50)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    results = {}
    for kernels in (True, False):
        llm = LLM(str(tiny_models["qwen2"]), dtype="bfloat16", kernels=kernels, block_size=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[kernels] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids)])
                            for o in outs]
    for (tok_k, lp_k), (tok_t, lp_t) in zip(results[True], results[False]):
        assert tok_k == tok_t
        assert max(abs(a - b) for a, b in zip(lp_k, lp_t)) < 0.1


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("packed_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp32(rows, packed_dtype, bias):
    """Every register-tile height (rows mod 6), a last panel of 7 columns (N = 103), K not a
    multiple of 8, both packings: fp32 inputs give the fp32 product, bf16 inputs its rounding."""
    torch.manual_seed(rows)
    weight, b = torch.randn(103, 75).bfloat16(), (torch.randn(103).bfloat16() if bias else None)
    packed = pack_linear(weight, b, packed_dtype)
    x = torch.randn(rows, 75)
    ref = F.linear(x, weight.float(), None if b is None else b.float())
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 103)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    out16 = packed(x.bfloat16().view(1, rows, 75))  # leading dims kept, bf16 in -> bf16 out
    ref16 = F.linear(x.bfloat16().float(), weight.float(), None if b is None else b.float())
    assert out16.dtype == torch.bfloat16 and out16.shape == (1, rows, 103)
    # NOTE: the fp32 sums differ from PyTorch's in order only, so the roundings agree within one bf16 step.
    torch.testing.assert_close(out16[0].float(), ref16, atol=1e-4, rtol=2**-7)


@pytest.mark.parametrize("packed_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_gated_packed_linear_is_silu_gate_times_up(packed_dtype, rows):
    """silu(gate) * up in the GEMM's epilogue, rounded like PyTorch's bf16 ops: same values as the
    unfused ops, within one bf16 step where the fp32 sums round differently."""
    torch.manual_seed(rows)
    intermediate, k = 24, 40
    weight, x = torch.randn(2 * intermediate, k).bfloat16(), torch.randn(rows, k).bfloat16()
    out = pack_linear(weight, None, packed_dtype, gated=True)(x)
    gate, up = F.linear(x.float(), weight.float()).bfloat16().split(intermediate, dim=-1)
    ref = F.silu(gate) * up
    assert out.dtype == torch.bfloat16 and out.shape == (rows, intermediate)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=2**-7)
    assert (out == ref).float().mean() > 0.9


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_rounds_like_hf(with_residual):
    """HF's LlamaRMSNorm on bf16: fp32 normalization, rounded to bf16, times the bf16 weight."""
    torch.manual_seed(3)
    x, delta, weight = torch.randn(37, 96).bfloat16(), torch.randn(37, 96).bfloat16(), torch.randn(96).bfloat16()
    out, residual = add_rms_norm_kernel()(x, delta if with_residual else None, weight, 1e-5)
    expected_residual = x + delta if with_residual else x
    assert torch.equal(residual, expected_residual)
    h = expected_residual.float()
    ref = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=2**-7)
    assert (out == ref).float().mean() > 0.98


def test_copy_rows_scatters_whole_rows():
    import numpy as np

    from kvbaton.kernels import copy_rows_kernel

    src = torch.randn(50, 96)
    dst = torch.zeros(40, 96)
    src_rows = np.array([3, 49, 0, 17, 18, 19, 7, 8, 30, 31, 2], dtype=np.int64)
    dst_rows = np.array([39, 0, 5, 6, 7, 8, 20, 1, 2, 3, 11], dtype=np.int64)
    copy_rows_kernel()(dst.data_ptr(), src.data_ptr(), dst_rows, src_rows, 96 * 4)
    expected = torch.zeros(40, 96)
    expected[torch.from_numpy(dst_rows)] = src[torch.from_numpy(src_rows)]
    assert torch.equal(dst, expected)


def test_loading_the_kernels_leaves_the_process_float_mode_alone():
    """Built with -ffast-math but linked without it: GCC's crtfastmath.o would otherwise turn on
    flush-to-zero for the whole process on load (a request's top_p of 5e-324 was read as 0.0)."""
    import subprocess
    import sys

    code = ("from kvbaton.kernels.build import cpu_kernels; import sys; "
            "sys.exit(2 if cpu_kernels() is None else (0 if float('5e-324') != 0.0 else 1))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 1, "loading the kernels turned on flush-to-zero for the process"
    assert result.returncode == 0, result.stderr
