"""KV quantization (int8, fp8_e4m3): rows round-trip within their format's error, the C kernels read quantized
pools exactly as PyTorch dequantizes them, a quantized row costs <= 55% of a bf16 one, and on the default model
over a fixed text the quality stays within its thresholds against bf16 KV (a regression fails here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton import LLM
from kvbaton.engine.kv_quality import compare, greedy_agreement, next_token_logprobs
from kvbaton.kernels import paged_decode_kernel, paged_prefill_kernel
from kvbaton.kernels.kv_quant import dequantize_rows, quantize_rows
from kvbaton.kv.layout import KVLayout
from tests.support.helpers import greedy

TEXT = Path(__file__).parent.parent / "data" / "kv_quality_text.txt"
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
# (perplexity delta vs bf16 KV, mean KL in nats, greedy agreement with bf16 KV over PROMPTS x NEW_TOKENS).
# NOTE: greedy agreement is harsh (a sequence differs everywhere after its first flip); measured on Emerald Rapids:
# int8 0.73, fp8 0.57 (float32 KV: 0.97). benchmarks/bench_kv_quant.py runs the full 100 prompts x 64 tokens.
THRESHOLDS = {"int8": (0.005, 0.005, 0.60), "fp8_e4m3": (0.02, 0.02, 0.45)}
PROMPTS, NEW_TOKENS = 32, 32


@pytest.mark.parametrize("kind", list(STORAGE))
def test_rows_round_trip_within_the_format_error(kind):
    torch.manual_seed(0)
    x = torch.randn(50, 2, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None, None]  # rows of every magnitude
    x[7] = 0.0  # an all-zero row stays exact
    back = dequantize_rows(quantize_rows(x, STORAGE[kind]), torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    err = ((back - x).abs() / amax.clamp_min(1e-30)).amax().item()
    assert err <= (0.5 / 127 + 1e-6 if kind == "int8" else 0.0625 + 1e-6)  # int8: half a step; e4m3: 3 mantissa bits
    assert torch.equal(back[7], torch.zeros_like(back[7]))


@pytest.mark.parametrize("kind", list(STORAGE))
def test_c_kernels_read_quantized_pools_as_pytorch_dequantizes_them(kind):
    decode = paged_decode_kernel(STORAGE[kind], 9, 3, 64)
    prefill = paged_prefill_kernel(STORAGE[kind], 9, 3, 64)
    if decode is None or prefill is None:
        pytest.skip("no C compiler: the PyTorch path is the only one")
    torch.manual_seed(1)
    pool = quantize_rows(torch.randn(40 * 16, 2, 3, 64), STORAGE[kind])
    dense = dequantize_rows(pool, torch.float32)
    table = torch.randperm(40)[:20].contiguous()
    for ctx in (5, 17, 130, 319):
        q = torch.randn(1, 9, 64)
        args = (table[None, : -(-ctx // 16)].contiguous(), torch.tensor([ctx]), 16, 0.125)
        ref = paged_decode_kernel(torch.float32, 9, 3, 64)(q, dense, *args)
        torch.testing.assert_close(decode(q, pool, *args), ref, rtol=1e-5, atol=1e-5)
        n = min(ctx, 7)
        qp = torch.randn(n, 9, 64)
        blocks = table[: -(-ctx // 16)].contiguous()
        ref = paged_prefill_kernel(torch.float32, 9, 3, 64)(qp, dense, blocks, ctx - n, 16, 0.125)
        torch.testing.assert_close(prefill(qp, pool, blocks, ctx - n, 16, 0.125), ref, rtol=1e-5, atol=1e-5)


def test_the_torch_free_layout_and_the_kernels_agree_on_the_row_format():
    from kvbaton.kernels import kv_quant
    from kvbaton.kv import layout

    assert layout.SCALE_BYTES == kv_quant.SCALE_BYTES
    assert "#define KV_SCALE_BYTES 4" in (Path(kv_quant.__file__).parent / "vec8.h").read_text()


@pytest.mark.parametrize("kind", list(STORAGE))
def test_a_quantized_token_costs_at_most_55_percent_of_bf16(kind):
    shape = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}
    bf16 = KVLayout.standard(dtype="bfloat16", **shape).bytes_per_block
    assert KVLayout.standard(dtype=kind, **shape).bytes_per_block <= 0.55 * bf16


@pytest.fixture(scope="module")
def text_ids(default_model_dir) -> list[int]:
    from kvbaton.text.tokenizer import Tokenizer

    return Tokenizer(default_model_dir).encode(TEXT.read_text())


@pytest.fixture(scope="module")
def bf16_logprobs(default_model_dir, text_ids) -> torch.Tensor:
    return next_token_logprobs(default_model_dir, text_ids, "bf16")


@pytest.fixture(scope="module")
def bf16_greedy(default_model_dir, text_ids) -> list[list[int]]:
    return greedy(LLM(dtype="float32", kv_cache_dtype="bf16"), NEW_TOKENS, _prompts(text_ids))


def _prompts(ids: list[int]) -> list[list[int]]:
    """Windows of the text: natural prompts, each 32 tokens."""
    return [ids[i * 8: i * 8 + 32] for i in range(PROMPTS)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STORAGE))
def test_quality_on_the_default_model_stays_within_thresholds(kind, default_model_dir, text_ids, bf16_logprobs,
                                                              bf16_greedy):
    max_ppl, max_kl, min_agree = THRESHOLDS[kind]
    report = compare(default_model_dir, text_ids, kind, bf16_logprobs)
    agree, prefix = greedy_agreement(bf16_greedy, greedy(LLM(dtype="float32", kv_cache_dtype=kind), NEW_TOKENS,
                                                         _prompts(text_ids)))
    print(f"{kind}: perplexity {report.perplexity:.4f} vs {report.reference_perplexity:.4f} "
          f"({report.perplexity_delta:+.3%}), KL {report.mean_kl:.5f}, greedy agreement {agree:.3f} "
          f"(identical prefix {prefix:.3f})")
    assert report.perplexity_delta <= max_ppl and report.mean_kl <= max_kl and agree >= min_agree
