"""KV quantization: each head's row of K or V as one-byte codes and an fp32 scale beside them
(`KVLayout` of dtype int8 or fp8_e4m3: rows of `head_dim + SCALE_BYTES` bytes).

    int8:      scale = max|x| / 127, codes = round(x / scale)           (symmetric, per token and head)
    fp8_e4m3:  scale = max|x| / 448, codes = e4m3(x / scale)            (448: e4m3's largest finite value)

The format is the C kernels' (vec8.h), so it lives beside them. The scale is per token and head for
both: a static per-head fp8 scale would need calibration data we do not have, and per-token scales
cost 4 bytes per 64-128 codes. The C attention kernels read these rows
directly (`kernels/vec8.h: load_kv_rows`); this module is the write path and the PyTorch read path.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an fp32 scale after each head's codes: vec8.h's KV_SCALE_BYTES, kvbaton.kv.layout's SCALE_BYTES
CODE_MAX = {torch.int8: 127.0, torch.uint8: 448.0}  # by pool storage type: int8 codes, fp8 e4m3 codes
_TINY = 1e-30  # an all-zero row gets scale 0 from this floor, and codes 0: it dequantizes to exact zeros


def is_quantized(pool: torch.Tensor) -> bool:
    return pool.dtype in CODE_MAX


def quantize_rows(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """x: [..., D] float -> [..., D + SCALE_BYTES] of `storage` (codes, then the row's fp32 scale's bytes)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = amax / CODE_MAX[storage]
    inv = torch.where(amax > _TINY, 1.0 / scale, torch.zeros_like(scale))
    if storage == torch.int8:
        codes = (x * inv).round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = (x * inv).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(storage)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + SCALE_BYTES] codes and scales -> [..., D] of `dtype`."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    codes = rows[..., :d]
    values = codes.float() if rows.dtype == torch.int8 else codes.contiguous().view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)
