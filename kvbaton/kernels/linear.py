"""Linear-layer kernels: a few rows streaming bf16 weights, many rows over pre-packed weights."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kvbaton.kernels.build import cpu_kernels

MAX_LINEAR_ROWS = 8  # linear_bf16.c's MAX_ROWS

# Gives a packed weight: calls its argument (which packs) or returns the same bytes kept from an earlier start
# (`kernels.pack_cache`).
Packer = Callable[[Callable[[], torch.Tensor]], torch.Tensor]


def pack_now(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The packer without a cache: pack."""
    return make()


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


def _padded_bias(bias: torch.Tensor | None, padded_n: int) -> torch.Tensor | None:
    """A bias as fp32, zero-padded to the packed weights' column count (the kernels read whole panels)."""
    if bias is None:
        return None
    out = torch.zeros(padded_n, dtype=torch.float32)
    out[: bias.shape[0]] = bias.detach().float()
    return out
# bf16 panels store columns in this order (see gemm_packed.c: one load, two in-lane interleaves)
BF16_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
_OUT_F32, _OUT_BF16, _OUT_SILU_MUL = 0, 1, 2  # gemm_packed.c's output modes


class PackedLinear:
    """A linear layer's weights packed once for `kvbaton_gemm_packed`; calling it computes x W^T + b.

    Any number of rows; meant for many (prefill chunks, batched decodes), where it beats PyTorch's
    fp32 GEMM (MKL) on this model's shapes, 64-row ones by up to 2x (gemm_packed.c). `gated=True`
    (a fused gate/up projection, weight = [gate; up]) returns silu(gate) * up instead, computed in
    the GEMM's epilogue (bf16 only)."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed_dtype: torch.dtype, gated: bool = False, packer: Packer = pack_now) -> None:
        if packed_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"weights can be packed as bfloat16 or float32, not {packed_dtype}")
        n, k = weight.shape
        if gated and (n % PANEL or bias is not None):
            raise ValueError(f"a gated projection needs 2 x a multiple of 8 outputs and no bias, got {n}")
        self._fn = lib.kvbaton_gemm_packed
        self.num_threads = num_threads
        self.gated = gated
        self.in_features, self.out_features = k, n // 2 if gated else n
        panels = -(-n // PANEL)
        self.weight = packer(functools.partial(self.pack, weight.detach(), packed_dtype, gated))
        self.bias = _padded_bias(bias, panels * PANEL)

    @staticmethod
    def pack(weight: torch.Tensor, packed_dtype: torch.dtype, gated: bool) -> torch.Tensor:
        """[N, K] -> [panels, K, 16] in `packed_dtype` (bf16: columns in BF16_PANEL_ORDER)."""
        n, k = weight.shape
        if gated:  # each panel: 8 gate rows, then the 8 up rows of the same outputs
            half = n // 2
            weight = torch.stack((weight[:half].view(-1, 8, k), weight[half:].view(-1, 8, k)), dim=1).view(n, k)
        panels = -(-n // PANEL)
        padded = torch.zeros(panels * PANEL, k, dtype=packed_dtype)
        padded[:n] = weight
        packed = padded.view(panels, PANEL, k).transpose(1, 2)  # [panels, K, 16]
        if packed_dtype == torch.bfloat16:
            packed = packed[..., list(BF16_PANEL_ORDER)]
        return packed.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] (bf16 or fp32) -> [..., N] in x's dtype, accumulated in fp32."""
        k, n = self.in_features, self.out_features
        if self.gated and x.dtype != torch.bfloat16:
            raise ValueError(f"the gated packed kernel computes bf16 activations, got {x.dtype}")
        x32 = x.reshape(-1, k).to(torch.float32).contiguous()
        out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        mode = _OUT_SILU_MUL if self.gated else _OUT_BF16 if out_dtype == torch.bfloat16 else _OUT_F32
        y = torch.empty(x32.shape[0], n, dtype=out_dtype)
        rc = self._fn(x32.data_ptr(), self.weight.data_ptr(), self.weight.element_size(),
                      0 if self.bias is None else self.bias.data_ptr(), y.data_ptr(), mode,
                      x32.shape[0], self.weight.shape[0] * PANEL if self.gated else n, k, self.num_threads)
        if rc != 0:
            raise ValueError(f"packed linear kernel: unsupported shape x {tuple(x.shape)}, w {(n, k)}")
        y = y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed_dtype: torch.dtype,
                gated: bool = False, packer: Packer = pack_now) -> PackedLinear | None:
    """`weight` [N, K] packed for the many-row kernel, or None without the kernels."""
    lib = cpu_kernels()
    return None if lib is None else PackedLinear(lib, torch.get_num_threads(), weight, bias, packed_dtype, gated,
                                                 packer)


ISA_GENERIC, ISA_AVX512_BF16 = 0, 1  # linear_dot.c's instruction sets


class DotLinear:
    """`kvbaton_linear_dot`: x W^T (+ b), one fixed-order dot product per output (linear_dot.c).

    Two uses: the decode linear on AVX512-BF16 CPUs (`avx512_bf16=True`: bf16 pairs multiplied by
    `vdpbf16ps` straight from the weights), and the batch-invariant linear of deterministic mode, where
    it takes every row count, because each output's sums do not depend on the batch."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, avx512_bf16: bool, max_rows: int | None) -> None:
        self._fn = lib.kvbaton_linear_dot
        self.num_threads = num_threads
        self.isa = ISA_AVX512_BF16 if avx512_bf16 else ISA_GENERIC
        self.max_rows = max_rows  # None: every row count (deterministic mode)

    def handles_rows(self, x: torch.Tensor) -> bool:
        return self.max_rows is None or x.numel() // x.shape[-1] <= self.max_rows

    def supports_weight(self, weight: torch.Tensor) -> bool:
        if not weight.is_contiguous():
            return False
        if self.isa == ISA_AVX512_BF16:
            return weight.dtype == torch.bfloat16
        return weight.dtype in (torch.bfloat16, torch.float32) and weight.shape[1] % 8 == 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [..., K] -> [..., N] in x's dtype (fp32 sums, rounded once to bf16 for bf16 x)."""
        n, k = weight.shape
        rows = x.numel() // k
        x_in = x.reshape(rows, k).to(torch.bfloat16 if self.isa == ISA_AVX512_BF16 else torch.float32).contiguous()
        out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        y = torch.empty(rows, n, dtype=out_dtype)
        b32 = None if bias is None else bias.to(torch.float32).contiguous()
        rc = self._fn(x_in.data_ptr(), weight.data_ptr(), weight.element_size(), 0 if b32 is None else b32.data_ptr(),
                      y.data_ptr(), _OUT_BF16 if out_dtype == torch.bfloat16 else _OUT_F32, rows, n, k, self.isa,
                      self.num_threads)
        if rc != 0:
            raise ValueError(f"dot linear kernel: unsupported shape x {tuple(x.shape)}, w {(n, k)}")
        y = y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def dot_linear(avx512_bf16: bool, max_rows: int | None = MAX_LINEAR_ROWS) -> DotLinear | None:
    lib = cpu_kernels()
    return None if lib is None else DotLinear(lib, torch.get_num_threads(), avx512_bf16, max_rows)



AMX_TILE_K = 32  # gemm_amx.c's TILE_K: K in multiples of this


class AMXLinear:
    """`kvbaton_gemm_amx`: x W^T (+ b) on AMX tiles, over weights packed once into 1 KiB B tiles
    ([N/16][K/32][16 k-pairs][16 columns][2]; gemm_amx.c). Batch-invariant (an output's sums never depend
    on the rows beside it), so it takes the rows up to `max_rows`, or every count (None)."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 max_rows: int | None, packer: Packer = pack_now) -> None:
        n, k = weight.shape
        if not self.supports_weight(weight):
            raise ValueError(f"the AMX GEMM takes bf16 weights with K a multiple of {AMX_TILE_K}, not "
                             f"{weight.dtype} {(n, k)}")
        self._fn = lib.kvbaton_gemm_amx
        self.num_threads = num_threads
        self.max_rows = max_rows
        self.in_features, self.out_features = k, n
        self.weight = packer(functools.partial(self.pack, weight.detach()))
        self.bias = _padded_bias(bias, -(-n // PANEL) * PANEL)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> [N/16, K/32, 16 k-pairs, 16 columns, 2]: one 1 KiB B tile per (column block, k block)."""
        n, k = weight.shape
        blocks = -(-n // PANEL)
        padded = torch.zeros(blocks * PANEL, k, dtype=torch.bfloat16)
        padded[:n] = weight
        return padded.view(blocks, PANEL, k // AMX_TILE_K, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    @staticmethod
    def supports_weight(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.shape[1] % AMX_TILE_K == 0

    def handles_rows(self, x: torch.Tensor) -> bool:
        return self.max_rows is None or x.numel() // x.shape[-1] <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        rows = x.numel() // k
        x16 = x.reshape(rows, k).to(torch.bfloat16).contiguous()
        out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        y = torch.empty(rows, n, dtype=out_dtype)
        rc = self._fn(x16.data_ptr(), self.weight.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(),
                      y.data_ptr(), _OUT_BF16 if out_dtype == torch.bfloat16 else _OUT_F32, rows, n, k,
                      self.num_threads)
        if rc != 0:
            raise ValueError(f"AMX GEMM: unsupported shape x {tuple(x.shape)}, w {(n, k)}")
        y = y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def pack_amx(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None,
             packer: Packer = pack_now) -> AMXLinear | None:
    """`weight` packed for the AMX GEMM; None without the kernels, for a weight it does not take, or where
    the OS refuses this process the AMX state."""
    lib = cpu_kernels()
    if lib is None or not AMXLinear.supports_weight(weight) or not amx_enabled():
        return None
    return AMXLinear(lib, torch.get_num_threads(), weight, bias, max_rows, packer)


@functools.cache
def amx_enabled() -> bool:
    """Ask Linux for the AMX register state (once per process: the grant is the process's for good)."""
    lib = cpu_kernels()
    return lib is not None and lib.kvbaton_amx_enable() == 0
