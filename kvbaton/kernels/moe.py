"""The MoE routed-experts kernel (`kvbaton_moe_experts`, moe_experts.c): one C call per MoE layer runs every
hit expert over its tokens and combines the weighted results, over expert weights packed once, in place.

Packing rewrites each expert's matrices inside the stacked parameters themselves (same bytes, no copy kept):
after `pack_` the parameters hold the kernel's layout and only the kernel may read them. bf16 weights only;
fp32 models (the parity oracle's dtype) keep PyTorch's expert loop.
"""

from __future__ import annotations

import ctypes

import torch

from kvbaton.kernels.build import cpu_kernels
from kvbaton.kernels.linear import BF16_PANEL_ORDER, amx_enabled

ISA_AVX2, ISA_AVX512_BF16, ISA_AMX = 0, 1, 2  # moe_experts.c's instruction sets
ISA_NAMES = {ISA_AVX2: "avx2", ISA_AVX512_BF16: "avx512-bf16", ISA_AMX: "amx"}
BLOCK = 16  # output columns per packed block / panel
TILE_K = 32  # tile layout: K per AMX B tile
GATE_MAX_ROWS = 16  # the C gate's reach (MoERouteKernel)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the tile layout [N/16, K/32, 16 k-pairs, 16 columns, 2] (a new tensor, same size)."""
    n, k = weight.shape
    return weight.reshape(n // BLOCK, BLOCK, k // TILE_K, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the panel layout [N/16, K, 16], columns in gemm_packed.c's bf16 order (a new tensor)."""
    n, k = weight.shape
    return weight.reshape(n // BLOCK, BLOCK, k).transpose(1, 2)[..., list(BF16_PANEL_ORDER)].contiguous()


def _interleave_gate_up(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[gate; up] ([2I, H]) -> groups of `width` gate rows, each followed by the same outputs' up rows."""
    half, k = weight.shape[0] // 2, weight.shape[1]
    gate, up = weight[:half].reshape(-1, width, k), weight[half:].reshape(-1, width, k)
    return torch.stack((gate, up), dim=1).reshape(2 * half, k)


class MoEExpertsKernel:
    """`kernel(x [T, H] bf16, ids [T, k], weights [T, k], gate_up, down) -> [T, H] bf16`, over weights this
    kernel packed (`pack_`). `amx_min_rows`: on ISA_AMX, experts with that many rows or more run on AMX tiles,
    fewer through the vdpbf16ps dot tile (1: AMX for every row count, batch-invariant)."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int, isa: int, amx_min_rows: int = 1) -> None:
        if isa not in ISA_NAMES:
            raise ValueError(f"unknown MoE kernel instruction set {isa}")
        self._fn = lib.kvbaton_moe_experts
        self.num_threads = num_threads
        self.isa = isa
        self.amx_min_rows = amx_min_rows

    @property
    def name(self) -> str:
        return ISA_NAMES[self.isa]

    def supports(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        """Stacked bf16 `gate_up` [E, 2I, H] and `down` [E, H, I] whose shapes the packed layout fills exactly."""
        if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16 or gate_up.dim() != 3:
            return False
        if not (gate_up.is_contiguous() and down.is_contiguous()):
            return False
        e, two_i, h = gate_up.shape
        inter = two_i // 2
        if tuple(down.shape) != (e, h, inter) or two_i % 2:
            return False
        if self.isa == ISA_AVX2:
            return inter % 8 == 0 and h % BLOCK == 0
        return h % TILE_K == 0 and inter % TILE_K == 0

    def pack_(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Rewrite the stacked weights into this kernel's layout in place, one expert at a time (the only
        extra memory: one expert's matrix while it is rearranged)."""
        if not self.supports(gate_up, down):
            raise ValueError(f"the {self.name} MoE kernel does not take experts of shapes {tuple(gate_up.shape)}, "
                             f"{tuple(down.shape)} ({gate_up.dtype})")
        tiles = self.isa != ISA_AVX2
        with torch.no_grad():
            for e in range(gate_up.shape[0]):
                fused = _interleave_gate_up(gate_up[e], BLOCK if tiles else 8)
                packed = pack_tiles(fused) if tiles else pack_panels(fused)
                gate_up[e].view(-1).copy_(packed.view(-1))
                packed = pack_tiles(down[e]) if tiles else pack_panels(down[e])
                down[e].view(-1).copy_(packed.view(-1))

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
        num_experts, two_i, h = gate_up.shape
        t, k = ids.shape
        x16 = x.reshape(t, h).to(torch.bfloat16).contiguous()
        ids64 = ids.to(torch.int64).contiguous()
        w32 = weights.to(torch.float32).contiguous()
        out = torch.empty(t, h, dtype=torch.bfloat16)
        rc = self._fn(x16.data_ptr(), ids64.data_ptr(), w32.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                      out.data_ptr(), t, k, num_experts, h, two_i // 2, self.isa, self.amx_min_rows, self.num_threads)
        if rc != 0:
            why = {-1: "unsupported shapes", -2: "an expert id out of range", -3: "out of memory"}.get(rc, str(rc))
            raise ValueError(f"MoE experts kernel ({self.name}): {why}: x {tuple(x.shape)}, ids {tuple(ids.shape)}, "
                             f"experts {tuple(gate_up.shape)}")
        return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


class MoERouteKernel:
    """`kvbaton_moe_route`: a softmax-scored gate in one call: `kernel(x [T, H], weight [E, H], k, renormalize)
    -> (weights [T, k] fp32, ids [T, k] int64)`, as TopKGate's softmax path computes them (logits rounded to
    bf16 like F.linear's bf16 output; ties to the lower expert id). Each token alone (batch-invariant): it
    beats PyTorch's six ops up to ~16 tokens (15 vs 50 us at one, 64 experts x 768, Xeon), so it takes the
    row counts up to `max_rows` (None: every count, for deterministic mode)."""

    MAX_EXPERTS = 1024  # moe_experts.c's MAX_ROUTE_EXPERTS

    def __init__(self, lib: ctypes.CDLL, num_threads: int, isa: int, max_rows: int | None = GATE_MAX_ROWS) -> None:
        self._fn = lib.kvbaton_moe_route
        self.num_threads = num_threads
        self.isa = isa
        self.max_rows = max_rows

    def handles_rows(self, x: torch.Tensor) -> bool:
        return self.max_rows is None or x.numel() // x.shape[-1] <= self.max_rows

    def supports(self, weight: torch.Tensor) -> bool:
        e, h = weight.shape
        width = 8 if self.isa == ISA_AVX2 else 32
        return (weight.dtype == torch.bfloat16 and weight.is_contiguous() and e <= self.MAX_EXPERTS
                and h % width == 0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        e, h = weight.shape
        x16 = x.reshape(-1, h).to(torch.bfloat16).contiguous()
        t = x16.shape[0]
        ids = torch.empty(t, k, dtype=torch.int64)
        weights = torch.empty(t, k, dtype=torch.float32)
        rc = self._fn(x16.data_ptr(), weight.data_ptr(), t, h, e, k, int(renormalize), self.isa, self.num_threads,
                      ids.data_ptr(), weights.data_ptr())
        if rc != 0:
            raise ValueError(f"MoE gate kernel: unsupported shapes x {tuple(x.shape)}, gate {(e, h)}, top-{k}")
        return weights, ids


def moe_route_kernel(isa: int, max_rows: int | None = GATE_MAX_ROWS) -> MoERouteKernel | None:
    lib = cpu_kernels()
    return None if lib is None else MoERouteKernel(lib, torch.get_num_threads(), isa, max_rows)


def moe_experts_kernel(isa: int, amx_min_rows: int = 1) -> MoEExpertsKernel | None:
    """The kernel for this instruction set, or None without the kernels (or, for ISA_AMX, without the OS's
    grant of the AMX state)."""
    lib = cpu_kernels()
    if lib is None or (isa == ISA_AMX and not amx_enabled()):
        return None
    return MoEExpertsKernel(lib, torch.get_num_threads(), isa, amx_min_rows)
