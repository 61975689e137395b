"""Paged attention kernels (decode: one query per request; prefill: a chunk of one request)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from kvbaton.kernels.build import cpu_kernels

# Limits compiled into paged_attention.c / paged_prefill.c (stack buffers); other shapes use PyTorch.
MAX_HEADS, MAX_HEAD_DIM, MAX_KV_ROW = 64, 256, 1024
MAX_PREFILL_GROUP = 48  # query heads per KV head (paged_prefill.c's MAX_ROWS)
# vec8.h's KV_* formats, by the pool's storage type (int8: int8 codes, uint8: fp8 e4m3 codes; both with scales)
KV_FORMATS = {torch.float32: 4, torch.bfloat16: 2, torch.int8: 1, torch.uint8: 3}


def _in_fp32(q: torch.Tensor, kv_cache: torch.Tensor, what: str, run: Callable[[int, int], int]) -> torch.Tensor:
    """Both kernels take fp32 queries [T, H, D] and write fp32 outputs of that shape:
    `run(q32_addr, out_addr)` returns the C status; the result comes back in q's dtype."""
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty_like(q32)
    if run(q32.data_ptr(), out.data_ptr()) != 0:
        raise ValueError(f"{what}: unsupported shape (q {tuple(q.shape)}, KV pool {tuple(kv_cache.shape)})")
    return out.to(q.dtype)


class PagedDecodeKernel:
    """`kvbaton_paged_decode_attention` with tensors in and out: one query token per request."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, split_context: bool = True) -> None:
        self._fn = lib.kvbaton_paged_decode_attention
        self.num_threads = num_threads
        # False: one partition per request, so its sums run in one order whatever the batch (deterministic mode)
        self.split_context = split_context

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        """q: [B, H, D]; kv_cache: [slots, 2, Hkv, D] (quantized: D + scale bytes);
        block_table: [B, nb] int64 (contiguous);
        context_lens: [B] int64 -> [B, H, D] in q's dtype."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        return _in_fp32(q, kv_cache, "paged decode kernel", lambda q32, out: self._fn(
            kv_cache.data_ptr(), KV_FORMATS[kv_cache.dtype], q32, out, block_table.data_ptr(), context_lens.data_ptr(),
            batch, block_table.shape[1], block_size, num_kv_heads, num_heads // num_kv_heads, head_dim, scale,
            self.num_threads, int(self.split_context)))


def paged_decode_kernel(kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        split_context: bool = True) -> PagedDecodeKernel | None:
    """The C decode kernel when it is built and handles these shapes, else None."""
    if kv_dtype not in KV_FORMATS or num_heads > MAX_HEADS or head_dim > MAX_HEAD_DIM:
        return None
    if head_dim % 8 or num_kv_heads * head_dim > MAX_KV_ROW:
        return None
    lib = cpu_kernels()
    if lib is None:
        return None
    return PagedDecodeKernel(lib, torch.get_num_threads(), split_context)


class PagedPrefillKernel:
    """`kvbaton_paged_prefill_attention`: causal attention of one request's prefill chunk, whose
    K/V (and its earlier context's) are already in the pool."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_paged_prefill_attention
        self.num_threads = num_threads

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, start_position: int,
                 block_size: int, scale: float) -> torch.Tensor:
        """q: [T, H, D] for context positions [start_position, start_position + T); blocks: [nb] int64
        (contiguous) covering them -> [T, H, D] in q's dtype."""
        tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        return _in_fp32(q, kv_cache, "paged prefill kernel", lambda q32, out: self._fn(
            kv_cache.data_ptr(), KV_FORMATS[kv_cache.dtype], q32, out, blocks.data_ptr(), start_position, tokens,
            block_size, num_kv_heads, num_heads // num_kv_heads, head_dim, scale, self.num_threads))


def paged_prefill_kernel(kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> PagedPrefillKernel | None:
    """The C prefill-attention kernel when it is built and handles these shapes, else None."""
    if kv_dtype not in KV_FORMATS or head_dim > MAX_HEAD_DIM or head_dim % 8:
        return None
    if num_heads // num_kv_heads > MAX_PREFILL_GROUP:
        return None
    lib = cpu_kernels()
    return None if lib is None else PagedPrefillKernel(lib, torch.get_num_threads())
