"""The C RoPE (rope_bf16.c) gives PyTorch's bf16 bits: the Python loop's prompt steps and the C layer loop use it,
so it must round exactly as `x.mul_(cos).addcmul_(swapped, sin)` does."""

from __future__ import annotations

import pytest
import torch

from kvbaton.kernels.rope import rope_kernel
from kvbaton.layers.rope import RotaryEmbedding

# NOTE: no skip: CI machines have gcc, so a kernel that fails to build must fail here.
kernel = rope_kernel()


@pytest.mark.parametrize("tokens", [1, 37, 300])  # 300 x 12 heads: the threaded branch
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 32)])
def test_c_rope_gives_pytorch_bits(tokens, heads, kv_heads, head_dim):
    torch.manual_seed(tokens + head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,))
    cos_sin = rope.cos_sin(positions)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim) * 4).bfloat16()  # v heads must stay as they are
    expected = qkv.clone()
    rope.kernel = None
    rope.apply_(expected[:, :heads + kv_heads], cos_sin)
    assert kernel is not None and kernel.handles(qkv[:, :heads + kv_heads], *cos_sin)
    rope.kernel = kernel
    rope.apply_(qkv[:, :heads + kv_heads], cos_sin)
    assert torch.equal(qkv, expected)
