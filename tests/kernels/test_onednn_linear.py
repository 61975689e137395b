"""The onednn-packed path (kvbaton.kernels.onednn): oneDNN over weights reordered once gives `F.linear`'s bits, and
the avx512-bf16 row's model computes its many-row linears with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbaton import LLM
from kvbaton.config import ConfigError
from kvbaton.kernels.onednn import onednn_linear
from kvbaton.layers.linear import Linear
from kvbaton.platform.compute import choose_compute_plan
from kvbaton.platform.cpu import detect_cpu

# NOTE: no skip for a PyTorch without oneDNN: the pinned x86 CPU wheel always has it.


@pytest.mark.parametrize("shape", [(1, 96), (17, 96), (300, 96), (2, 5, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_reordered_weights_give_f_linear_bits(shape, bias):
    torch.manual_seed(shape[0])
    weight = torch.randn(200, 96).bfloat16()
    b = torch.randn(200).bfloat16() if bias else None
    x = torch.randn(*shape).bfloat16()
    linear = onednn_linear(weight, b)
    assert linear is not None
    assert torch.equal(linear(x), F.linear(x, weight, b))


def test_only_bf16_weights_are_reordered():
    assert onednn_linear(torch.randn(8, 16), None) is None


def test_the_avx512_bf16_row_reorders_its_linears(tiny_models):
    try:
        choose_compute_plan(detect_cpu(), "bfloat16", "avx512-bf16")
    except ConfigError as exc:
        pytest.skip(f"this CPU cannot run it: {exc}")
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", compute_path="avx512-bf16")
    linears = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.onednn is not None for m in linears)
    out = llm.generate([{"prompt_token_ids": list(range(1, 40))}])[0]
    assert len(out.outputs[0].token_ids) > 0
