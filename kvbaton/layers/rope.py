"""Rotary position embedding with a precomputed cos/sin table (HF's rotate-half layout)."""

from __future__ import annotations

import math

import torch

from kvbaton.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """`1 / theta^(2i/d)`, adjusted by Llama-3 scaling: long wavelengths are slowed down."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """`cos_sin(positions)` once per step; `apply_` rotates any number of heads in place."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling, dtype)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_table()

    def build_table(self) -> None:
        """(Re)compute the cos/sin table; needed after the module was created on `meta`."""
        head_dim, max_positions, theta, scaling, dtype = self._args
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        half = head_dim // 2
        # NOTE: rotate_half(x) * sin == swap_halves(x) * signed_sin with signed_sin = [-sin, sin],
        # which turns the rotation into one flip and two fused multiply-adds.
        signed_sin = emb.sin()
        signed_sin[:, :half] = -signed_sin[:, :half]
        # NOTE: cast to the model dtype exactly where HF does, so bf16 runs match it too.
        self.cos = emb.cos().to(dtype=dtype, device="cpu")
        self.sin = signed_sin.to(dtype=dtype, device="cpu")

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D] each

    @staticmethod
    def apply_(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rotate x: [T, heads, D] in place."""
        cos, sin = cos_sin
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
        x.mul_(cos).addcmul_(swapped, sin)
