"""What this CPU can do natively, as torch sees it (issue 11 grows this into the per-layer path table)."""

from __future__ import annotations

import torch


def has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run in hardware (oneDNN), not emulated through fp32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
