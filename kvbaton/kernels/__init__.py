"""Hand-written CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

They are plain C (no PyTorch headers), so a build takes about a second; the shared object is
cached under `<cache root>/kernels/`, keyed by the source, the flags and the CPU, because
`-march=native` code is only valid on the CPU it was built for. Without a compiler, or with
`KVBATON_KERNELS=0`, `cpu_kernels()` returns None and callers use their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "paged_prefill.c", "linear_bf16.c", "gemm_packed.c", "copy_rows.c")
HEADERS = ("vec8.h",)
# Limits compiled into paged_attention.c (stack buffers); other shapes use the PyTorch path.
MAX_HEADS, MAX_HEAD_DIM, MAX_KV_ROW = 64, 256, 1024
MAX_LINEAR_ROWS = 8
MAX_PREFILL_GROUP = 64  # query heads per KV head (paged_prefill.c's MAX_ROWS)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith(("flags", "Features"))), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


def _build(out: Path, compiler: str) -> None:
    srcs = [str(Path(__file__).with_name(s)) for s in SOURCES]
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build into a temp file and rename, so concurrent first uses never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, *srcs, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    if os.environ.get("KVBATON_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: using the PyTorch attention path (slower on CPU)")
        return None
    from kvbaton.models.registry import cache_root

    digest = hashlib.sha256()
    for s in (*SOURCES, *HEADERS):
        digest.update(Path(__file__).with_name(s).read_bytes())
    digest.update(" ".join(CFLAGS).encode() + compiler.encode() + _cpu_fingerprint().encode())
    out = cache_root() / "kernels" / f"libkvbaton_cpu-{digest.hexdigest()[:16]}.so"
    try:
        if not out.exists():
            _build(out, compiler)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU kernels failed, using the PyTorch path: %s", detail)
        return None
    fn = lib.kvbaton_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_float, ctypes.c_int]
    fn = lib.kvbaton_copy_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int]
    fn = lib.kvbaton_linear_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    fn = lib.kvbaton_paged_prefill_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    fn = lib.kvbaton_gemm_packed
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


class PagedDecodeKernel:
    """`kvbaton_paged_decode_attention` with tensors in and out: one query token per request."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_paged_decode_attention
        self.num_threads = num_threads

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        """q: [B, H, D]; kv_cache: [slots, 2, Hkv, D]; block_table: [B, nb] int64 (contiguous);
        context_lens: [B] int64 -> [B, H, D] in q's dtype."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        rc = self._fn(kv_cache.data_ptr(), kv_cache.element_size(), q32.data_ptr(), out.data_ptr(),
                      block_table.data_ptr(), context_lens.data_ptr(), batch, block_table.shape[1], block_size,
                      num_kv_heads, num_heads // num_kv_heads, head_dim, scale, self.num_threads)
        if rc != 0:
            raise ValueError(f"paged decode kernel: unsupported shape (heads {num_heads}/{num_kv_heads}, "
                             f"head_dim {head_dim}, block_size {block_size})")
        return out.to(q.dtype)


def paged_decode_kernel(kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> PagedDecodeKernel | None:
    """The C decode kernel when it is built and handles these shapes, else None."""
    if kv_dtype not in (torch.bfloat16, torch.float32) or num_heads > MAX_HEADS or head_dim > MAX_HEAD_DIM:
        return None
    if head_dim % 8 or num_kv_heads * head_dim > MAX_KV_ROW:
        return None
    lib = cpu_kernels()
    if lib is None:
        return None
    return PagedDecodeKernel(lib, torch.get_num_threads())


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
        q32 = q.to(torch.float32).contiguous()
        out = torch.empty_like(q32)
        rc = self._fn(kv_cache.data_ptr(), kv_cache.element_size(), q32.data_ptr(), out.data_ptr(), blocks.data_ptr(),
                      start_position, tokens, block_size, num_kv_heads, num_heads // num_kv_heads, head_dim, scale,
                      self.num_threads)
        if rc != 0:
            raise ValueError(f"paged prefill kernel: unsupported shape (heads {num_heads}/{num_kv_heads}, "
                             f"head_dim {head_dim})")
        return out.to(q.dtype)


def paged_prefill_kernel(kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> PagedPrefillKernel | None:
    """The C prefill-attention kernel when it is built and handles these shapes, else None."""
    if kv_dtype not in (torch.bfloat16, torch.float32) or head_dim > MAX_HEAD_DIM or head_dim % 8:
        return None
    if num_heads // num_kv_heads > MAX_PREFILL_GROUP:
        return None
    lib = cpu_kernels()
    return None if lib is None else PagedPrefillKernel(lib, torch.get_num_threads())


class SmallBatchLinear:
    """`kvbaton_linear_bf16`: x [M, K] @ bf16 W [N, K]^T for M <= MAX_LINEAR_ROWS rows (decode steps)."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._fn = lib.kvbaton_linear_bf16
        self.num_threads = num_threads

    @staticmethod
    def supports_weight(weight: torch.Tensor) -> bool:
        """What does not change from step to step: checked once per layer, when paths are chosen."""
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 8 == 0 and weight.is_contiguous()

    @staticmethod
    def handles_rows(x: torch.Tensor) -> bool:
        return 1 <= x.numel() // x.shape[-1] <= MAX_LINEAR_ROWS

    def handles(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.supports_weight(weight) and self.handles_rows(x)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = weight.shape
        x32 = x.reshape(-1, k).to(torch.float32).contiguous()
        y = torch.empty(x32.shape[0], n, dtype=torch.float32)
        b32 = None if bias is None else bias.to(torch.float32).contiguous()
        rc = self._fn(x32.data_ptr(), weight.data_ptr(), 0 if b32 is None else b32.data_ptr(), y.data_ptr(),
                      x32.shape[0], n, k, self.num_threads)
        if rc != 0:
            raise ValueError(f"small-batch linear kernel: unsupported shape x {tuple(x.shape)}, w {(n, k)}")
        return y.view(*x.shape[:-1], n).to(x.dtype)


def small_batch_linear() -> SmallBatchLinear | None:
    lib = cpu_kernels()
    return None if lib is None else SmallBatchLinear(lib, torch.get_num_threads())


PANEL = 16  # output columns per packed weight panel (gemm_packed.c's NR)
# bf16 panels store columns in this order (see gemm_packed.c: one load, two in-lane interleaves)
BF16_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


class PackedLinear:
    """A linear layer's weights packed once for `kvbaton_gemm_packed`; calling it computes x W^T + b.

    Any number of rows; meant for many (prefill chunks, batched decodes), where it beats PyTorch's
    fp32 GEMM by not re-packing the weights on every call."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed_dtype: torch.dtype) -> None:
        if packed_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"weights can be packed as bfloat16 or float32, not {packed_dtype}")
        self._fn = lib.kvbaton_gemm_packed
        self.num_threads = num_threads
        self.out_features, self.in_features = n, k = weight.shape
        panels = -(-n // PANEL)
        padded = torch.zeros(panels * PANEL, k, dtype=packed_dtype)
        padded[:n] = weight.detach()
        packed = padded.view(panels, PANEL, k).transpose(1, 2)  # [panels, K, 16]
        if packed_dtype == torch.bfloat16:
            packed = packed[..., list(BF16_PANEL_ORDER)]
        self.weight = packed.contiguous()
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(panels * PANEL, dtype=torch.float32)
            self.bias[:n] = bias.detach().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] (bf16 or fp32) -> [..., N] in x's dtype, accumulated in fp32."""
        k, n = self.in_features, self.out_features
        x32 = x.reshape(-1, k).to(torch.float32).contiguous()
        out_bf16 = x.dtype == torch.bfloat16
        y = torch.empty(x32.shape[0], n, dtype=torch.bfloat16 if out_bf16 else torch.float32)
        rc = self._fn(x32.data_ptr(), self.weight.data_ptr(), self.weight.element_size(),
                      0 if self.bias is None else self.bias.data_ptr(), y.data_ptr(), int(out_bf16),
                      x32.shape[0], n, k, self.num_threads)
        if rc != 0:
            raise ValueError(f"packed linear kernel: unsupported shape x {tuple(x.shape)}, w {(n, k)}")
        y = y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed_dtype: torch.dtype) -> PackedLinear | None:
    """`weight` [N, K] packed for the many-row kernel, or None without the kernels."""
    lib = cpu_kernels()
    return None if lib is None else PackedLinear(lib, torch.get_num_threads(), weight, bias, packed_dtype)


def copy_rows_kernel():
    """`fn(dst_addr, src_addr, dst_rows: int64 array, src_rows: int64 array, row_bytes)` or None.

    Callers bound-check the rows first: this copies by raw address."""
    lib = cpu_kernels()
    if lib is None:
        return None
    fn, threads = lib.kvbaton_copy_rows, max(1, torch.get_num_threads())

    def copy(dst_addr: int, src_addr: int, dst_rows, src_rows, row_bytes: int) -> None:
        fn(dst_addr, src_addr, dst_rows.ctypes.data, src_rows.ctypes.data, len(dst_rows), row_bytes, threads)

    return copy
