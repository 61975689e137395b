"""Which code computes each kind of layer, chosen from one table by CPU, dtype and mode.

Every engine picks one `ComputePlan` at start-up (`choose_compute_plan`), logs it, reports it in
`/stats` and the benchmark headers, and applies it to its model (`kvbaton.layers.compute_paths`).
`--compute-path` names a row of the table instead of letting the CPU choose; `--deterministic`
replaces the row by its batch-invariant variant.

Why these rows (2-core machines, SmolLM2-135M, benchmarks/results/platform.md):
- amx (AVX512-BF16 and AMX-BF16: Sapphire Rapids and later): one row (batch-1 decode) streams the
  weights through `vdpbf16ps` at ~2x oneDNN's bandwidth; 2-512 rows run kvbaton's AMX tile GEMM
  (1.5-1.7x oneDNN's on decode batches, as fast at 512, and batch-invariant), more rows oneDNN;
  SDPA's flash kernel takes prefill attention (it beats kvbaton's AVX2-tuned C there), and the
  fused residual-add + RMSNorm kernel replaces torch's bf16 rms_norm (~100 us a call).
- avx512-bf16 (AVX512-BF16 without AMX: Zen 4/5, Cooper Lake): the dot kernel up to 16 rows, and the C
  layer loop with it (Zen 4, 2 cores: a decode step of 8 rows 12.6 ms, 19.4 in the Python loop with
  oneDNN); oneDNN beyond, over weights reordered once at load (`F.linear` repacks them on every call:
  14-25% of a linear's time at 17-2048 rows); norms as amx; the C kernels for prefill attention too:
  without AMX, SDPA's flash kernel takes 6x the time of paged_prefill.c's vdpbf16ps tiles on a causal
  512-token prompt (3.3 vs 0.55 ms a layer of SmolLM2 on Zen 4, 2 cores; 32 vs 7.8 ms at 2048 tokens).
- avx2 (AVX2 without native bf16): bf16 GEMMs are emulated, so kvbaton's C kernels take every
  linear: a streaming kernel for a few rows, a packed fp32-accumulating GEMM (gate/up fused with
  SiLU) for many, and a fused residual-add + RMSNorm.
- onednn: PyTorch (oneDNN / MKL) for every linear and norm, the C kernels for attention only.
- torch: no C code at all (no compiler, or to compare against).
float32 models (the parity oracle's dtype) compute linears in PyTorch's fp32 GEMMs on every row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from kvbaton.config import ConfigError
from kvbaton.platform.cpu import CPUInfo

COMPUTE_PATHS = ("auto", "amx", "avx512-bf16", "avx2", "onednn", "torch")

# What computes a linear layer: kvbaton's C kernels (dot-avx512bf16 / dot-generic: linear_dot.c;
# stream-avx2: linear_bf16.c; packed: gemm_packed.c; amx: gemm_amx.c) or PyTorch ("torch": oneDNN for bf16 on native
# CPUs, MKL for fp32; "torch-fp32": upcast to fp32 first, for emulated bf16 without kernels).
# onednn-packed: oneDNN over weights reordered once at load (kernels/onednn.py)
LinearCode = Literal["dot-avx512bf16", "dot-generic", "stream-avx2", "packed", "amx", "onednn-packed", "torch",
                     "torch-fp32"]
NormCode = Literal["c", "torch"]
# c: the C kernels for decode and prefill; c+sdpa: C decode, PyTorch's fused SDPA (flash) for prefill;
# c-per-token: every token attends as a decode query over its unsplit context (batch-invariant)
AttentionCode = Literal["c", "c+sdpa", "c-per-token", "torch"]


@dataclass(frozen=True)
class ComputePlan:
    path: str  # the table's row (one of COMPUTE_PATHS but "auto")
    dtype: str  # "bfloat16" | "float32"
    few_rows_linear: LinearCode  # up to `few_rows` rows: decode steps
    many_rows_linear: LinearCode  # more rows: prefill chunks, big decode batches
    norm: NormCode
    attention: AttentionCode
    deterministic: bool
    reason: str  # why this row
    # where few_rows_linear stops: linear_bf16.c's MAX_ROWS (avx2); the dot kernel ties oneDNN at ~8 rows of
    # decode shapes on a 2-core Xeon and at ~16-20 on a 2-core Zen 4 (avx512-bf16: 16); the AMX GEMM beats it
    # from 2 (amx: 1)
    few_rows: int = 8
    # amx: the tile GEMM takes up to this many rows (None: every count), oneDNN beyond: at 2048 rows its
    # blocking beats ours (3.2 vs 5.1 ms on gate/up), up to 512 ours is as fast or faster (Xeon, 2 cores)
    tile_rows: int | None = None

    def summary(self) -> str:
        many = self.many_rows_linear + (f" (<= {self.tile_rows} rows) / torch" if self.tile_rows else "")
        linears = (self.few_rows_linear if self.few_rows_linear == self.many_rows_linear
                   else f"{self.few_rows_linear} (<= {self.few_rows} rows) / {many}")
        mode = ", deterministic" if self.deterministic else ""
        return (f"{self.path}{mode} [{self.dtype}]: linears {linears}; norms {self.norm}; attention "
                f"{self.attention} ({self.reason})")


def choose_compute_plan(cpu: CPUInfo, dtype: str, requested: str = "auto", deterministic: bool = False,
                        kernels_available: bool = True, amx_granted: bool = True) -> ComputePlan:
    """The table's row for this CPU and dtype (or the `requested` one, refused with a ConfigError where
    this machine cannot run it), then its deterministic variant if asked for. `amx_granted`: the OS gave
    this process the AMX register state (Linux 5.16 and later do when asked)."""
    if requested not in COMPUTE_PATHS:
        raise ConfigError(f"unknown compute path {requested!r}; choose one of {', '.join(COMPUTE_PATHS)}")
    if dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"compute paths are chosen for bfloat16 or float32, not {dtype!r}")
    path, reason = requested, "asked for (--compute-path)"
    if requested == "auto":
        path, reason = _auto_path(cpu, kernels_available, amx_granted)
    _check_runs_here(path, cpu, kernels_available, amx_granted)
    plan = _row(path, dtype, reason, cpu.native_bf16)
    return _deterministic(plan, kernels_available) if deterministic else plan


def _auto_path(cpu: CPUInfo, kernels_available: bool, amx_granted: bool) -> tuple[str, str]:
    if not kernels_available:
        return "torch", "the C kernels could not be built here (no compiler, or KVBATON_KERNELS=0)"
    if cpu.avx512_bf16 and cpu.amx_bf16 and amx_granted:
        return "amx", "this CPU has native bf16 (AVX512-BF16 and AMX tiles)"
    if cpu.avx512_bf16:
        no_amx = "the OS refused this process AMX" if cpu.amx_bf16 else "no AMX"
        return "avx512-bf16", f"this CPU has native bf16 (AVX512-BF16, {no_amx})"
    if cpu.native_bf16:  # AMX without AVX512-BF16: no such CPU ships today, but oneDNN would use it
        return "onednn", "this CPU has native bf16 (AMX)"
    if cpu.arch in ("x86_64", "AMD64") and cpu.avx2:
        return "avx2", "this CPU emulates bf16 (AVX2, no AVX512-BF16)"
    return "onednn", f"no kvbaton kernel path for {cpu.arch} without AVX2; the C attention kernels are portable"


def _check_runs_here(path: str, cpu: CPUInfo, kernels_available: bool, amx_granted: bool) -> None:
    if path != "torch" and not kernels_available:
        raise ConfigError(f"compute path {path!r} needs kvbaton's C kernels, which could not be built here "
                          "(no C compiler, or KVBATON_KERNELS=0); use --compute-path torch")
    if path == "amx" and not (cpu.amx_bf16 and cpu.avx512_bf16):
        raise ConfigError("compute path 'amx' needs a CPU with AMX-BF16 and AVX512-BF16; this one has: "
                          f"{cpu.summary()}")
    if path == "amx" and not amx_granted:
        raise ConfigError("compute path 'amx': the OS refused this process the AMX register state "
                          "(arch_prctl ARCH_REQ_XCOMP_PERM needs Linux 5.16 or later); use avx512-bf16")
    if path == "avx512-bf16" and not cpu.avx512_bf16:
        raise ConfigError("compute path 'avx512-bf16' needs a CPU with AVX512-BF16; this one has: "
                          f"{cpu.summary()}")
    if path == "avx2" and not cpu.avx2:
        raise ConfigError(f"compute path 'avx2' needs a CPU with AVX2 and FMA; this one has: {cpu.summary()}")


def _row(path: str, dtype: str, reason: str, native_bf16: bool) -> ComputePlan:
    if dtype == "float32":  # the parity oracle's dtype: PyTorch's fp32 GEMMs; C attention where built
        attention: AttentionCode = "torch" if path == "torch" else "c"
        return ComputePlan(path, dtype, "torch", "torch", "torch", attention, False, reason)
    rows: dict[str, tuple[LinearCode, LinearCode, NormCode, AttentionCode]] = {
        "amx": ("dot-avx512bf16", "amx", "c", "c+sdpa"),
        "avx512-bf16": ("dot-avx512bf16", "onednn-packed", "c", "c"),
        "avx2": ("stream-avx2", "packed", "c", "c"),
        "onednn": ("torch", "torch", "torch", "c"),
        # NOTE: emulated bf16 GEMMs lose to fp32 ones from ~16 rows on (2-core AVX2 EPYC), so many rows upcast
        "torch": ("torch", "torch" if native_bf16 else "torch-fp32", "torch", "torch"),
    }
    few, many, norm, attention = rows[path]
    # the dot kernel's reach: the AMX GEMM beats it from 2 rows (bench_linear_kernels.py), oneDNN from ~16-20
    # on Zen 4 (avx512-bf16)
    few_rows = {"amx": 1, "avx512-bf16": 16}.get(path, 8)
    return ComputePlan(path, dtype, few, many, norm, attention, False, reason, few_rows,
                       tile_rows=512 if many == "amx" else None)


def _deterministic(plan: ComputePlan, kernels_available: bool) -> ComputePlan:
    """Batch-invariant variant: every linear one fixed-order sum per output for any row count (AMX tiles
    or a dot product), the residual-add + norm kernel row by row, every token (prefill ones too)
    attending as a decode query over one unsplit context. All of it is C: PyTorch's GEMMs choose their
    blocking by shape."""
    if not kernels_available or plan.path == "torch":
        raise ConfigError("--deterministic needs kvbaton's C kernels (the batch-invariant linear and attention), "
                          "which the 'torch' compute path does not use or could not be built here")
    # NOTE: by the row, not the CPU: `--compute-path avx2 --deterministic` is the AVX2 machines' setup, so it can be
    # checked against the avx512-bf16 one on one machine (the two differ from each other, each is batch-invariant).
    linear: LinearCode = "dot-generic"
    if plan.dtype == "bfloat16" and plan.path in ("amx", "avx512-bf16"):
        # amx: AMX tiles for every row count, and the vdpbf16ps dot kernel for a weight they do not take
        linear = "amx" if plan.path == "amx" else "dot-avx512bf16"
    norm: NormCode = "c" if plan.dtype == "bfloat16" else "torch"
    return replace(plan, few_rows_linear=linear, many_rows_linear=linear, norm=norm, attention="c-per-token",
                   deterministic=True, tile_rows=None)
