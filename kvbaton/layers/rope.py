"""Rotary position embedding with a precomputed cos/sin table (HF's rotate-half layout); Llama-3 and YaRN
scaling computed as transformers computes them (`modeling_rope_utils`)."""

from __future__ import annotations

import math

import torch

from kvbaton.config import RopeScaling
from kvbaton.kernels.rope import Rope


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """`1 / theta^(2i/d)`, adjusted by Llama-3 scaling (long wavelengths are slowed down) or YaRN."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, pos_freqs, scaling)
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (1 for other RoPE types)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return float(yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def _yarn_inverse_frequencies(dim: int, base: float, pos_freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Extrapolated (high) frequencies where a dimension turns more than `beta_fast` times over the original
    context, interpolated (divided by `factor`) below `beta_slow` turns, a linear ramp between."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(torch.nn.Module):
    """`cos_sin(positions)` once per step; `apply_` rotates any number of heads in place."""

    kernel: Rope | None = None  # the C rotation (set by the compute plan), else PyTorch's

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 dtype: torch.dtype, mrope_section: tuple[int, ...] = ()) -> None:
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling, dtype)
        # multimodal RoPE (Qwen2-VL): which of the (t, row, column) positions rotates each of the head's
        # frequencies, by sections, the same in both halves; None: one position per token
        self.axis_of = (torch.tensor([axis for _ in range(2) for axis, n in enumerate(mrope_section)
                                      for _ in range(n)], dtype=torch.long, device="cpu") if mrope_section else None)
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
        cos, signed_sin = emb.cos(), emb.sin()
        factor = attention_factor(scaling)
        if factor != 1.0:  # YaRN
            cos, signed_sin = cos * factor, signed_sin * factor
        # NOTE: rotate_half(x) * sin == swap_halves(x) * signed_sin with signed_sin = [-sin, sin],
        # which turns the rotation into one flip and two fused multiply-adds.
        signed_sin[:, :half] = -signed_sin[:, :half]
        # NOTE: cast to the model dtype exactly where HF does, so bf16 runs match it too.
        self.cos = cos.to(dtype=dtype, device="cpu")
        self.sin = signed_sin.to(dtype=dtype, device="cpu")

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] at `positions` [T], or with multimodal RoPE [3, T] (t, row, column):
        each frequency at the position of its section's axis."""
        if positions.dim() == 2:
            if self.axis_of is None:
                raise ValueError("(t, row, column) positions for a model without multimodal RoPE")
            at = positions[self.axis_of].T  # [T, D]: the position each frequency of each token is rotated by
            return self.cos.gather(0, at).unsqueeze(1), self.sin.gather(0, at).unsqueeze(1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D] each

    def apply_(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rotate x: [T, heads, D] in place (the C kernel, where the compute plan set one: the same bits)."""
        cos, sin = cos_sin
        if self.kernel is not None and x.numel() and self.kernel.handles(x, cos, sin):
            self.kernel(x, cos, sin)
            return
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
        x.mul_(cos).addcmul_(swapped, sin)
