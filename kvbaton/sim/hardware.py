"""Accelerator presets for the roofline: peak FLOP/s, memory size and bandwidth, the intra-node link.

Peaks are the vendors' dense (no sparsity) figures; a roofline reaches them only times a stated efficiency:
  compute_efficiency 0.5    the MFU a well-tuned engine reaches in prefill of a large dense model (public vLLM /
                            SGLang prefill figures for 8B-70B models on H100 sit at 40-60% of dense peak)
  bandwidth_efficiency 0.8  what a decode step's weight and KV reads reach of peak HBM bandwidth (memory-bound
                            GEMV kernels and paged attention report 75-90%)
  link_efficiency 0.8       NCCL all-reduce bus bandwidth over NVLink, as links.py's presets use
Memory sizes are what `nvidia-smi` reports as total (a little more than the marketing "80 GB").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvbaton.config import ConfigError
from kvbaton.sim.model_spec import Dtype

_MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device of a node (a GPU, or a whole CPU socket)."""

    name: str
    description: str
    bf16_flops: float  # dense peak, per device (fp16 is the same on every preset)
    fp8_flops: float | None  # None: no fp8 tensor cores; fp8 weights then compute at the bf16 rate
    memory_bytes: int
    memory_bandwidth: float  # bytes/s, peak
    link_bandwidth: float  # bytes/s one direction, per device, to the other devices of its node (TP, PP)
    link_latency_s: float = 10e-6  # per collective call (NCCL's small-message all-reduce on NVLink: ~10 us)
    devices_per_node: int = 8
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    link_efficiency: float = 0.8
    # The engine's host-side cost of one step (schedule, prepare inputs, sample): on GPUs an assumption (vLLM
    # with CUDA graphs spends ~1-3 ms), on the CPU preset measured.
    step_overhead_s: float = 0.002
    # Memory no engine can give to weights or KV: the CUDA context, CUDA graphs, NCCL buffers (an assumption:
    # vLLM logs ~1-2 GiB of these on an 80 GB GPU); on the CPU preset, the Python process and torch.
    reserved_bytes: int = 3 * 2**29

    def __post_init__(self) -> None:
        rates = (self.bf16_flops, self.memory_bandwidth, self.link_bandwidth, self.memory_bytes)
        effs = (self.compute_efficiency, self.bandwidth_efficiency, self.link_efficiency)
        if min(rates) <= 0 or not all(0 < e <= 1 for e in effs) or self.devices_per_node < 1:
            raise ConfigError(f"hardware {self.name!r}: rates must be positive and efficiencies in (0, 1]")
        if self.link_latency_s < 0 or self.step_overhead_s < 0:
            raise ConfigError(f"hardware {self.name!r}: latencies must be non-negative")

    def achieved_flops(self, dtype: Dtype) -> float:
        """FLOP/s a matmul of `dtype` weights reaches (fp8 only where there are fp8 tensor cores)."""
        fp8 = dtype in (Dtype.FP8, Dtype.INT8, Dtype.INT4) and self.fp8_flops is not None
        return (self.fp8_flops if fp8 and self.fp8_flops else self.bf16_flops) * self.compute_efficiency

    @property
    def achieved_bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency

    @property
    def achieved_link_bandwidth(self) -> float:
        return self.link_bandwidth * self.link_efficiency

    @property
    def machine_balance(self) -> float:
        """FLOPs per byte at which bf16 compute and memory take equal time: below it a step is memory-bound."""
        return self.bf16_flops * self.compute_efficiency / self.achieved_bandwidth


def _nvidia(name: str, description: str, tflops: float, fp8_tflops: float | None, memory_mib: int, tb_s: float,
            nvlink_gb_s: float) -> Hardware:
    # NOTE: NVLink figures are quoted bidirectional; a ring all-reduce streams one direction per link
    return Hardware(name=name, description=description, bf16_flops=tflops * 1e12,
                    fp8_flops=None if fp8_tflops is None else fp8_tflops * 1e12, memory_bytes=memory_mib * _MIB,
                    memory_bandwidth=tb_s * 1e12, link_bandwidth=nvlink_gb_s / 2 * 1e9)


# The CPU kvbaton is developed on: a KVM guest of 2 vCPUs of an Intel Xeon (family 6 model 207, Emerald Rapids
# class) with AVX512-BF16 and AMX, 23.5 GiB of memory. Measured here, not from a datasheet:
#   bf16 FLOP/s: 0.58 T = the default model's linears (2 x 134.5 M params x 512 rows) in 237.7 ms on AMX tiles
#                (benchmarks/results/linear-kernels.md, 512 rows); whole-model prefill reaches 1596 tok/s =
#                0.43 T (engine.md), so compute_efficiency 0.74 of that
#   bandwidth:   21 GB/s read (22.7 in linear-kernels.md, 20.1 in engine.md, 19.7-26.3 across moe.md's runs);
#                decode steps reach 63-86% of the weight-read roofline (moe.md): bandwidth_efficiency 0.75
#   overhead:    the engine's batch-1 decode step is 33.45 ms against 14.05 ms of reads at 20.1 GB/s
#                (engine.md): ~16 ms of per-step host work beyond the reads at 75% efficiency
XEON_AMX_2VCPU = Hardware(name="xeon-amx-2vcpu", description="2-vCPU Xeon (Emerald Rapids class) with AMX, measured",
                          bf16_flops=0.58e12, fp8_flops=None, memory_bytes=24683584 * 1024, memory_bandwidth=21e9,
                          link_bandwidth=3.9e9, link_latency_s=500e-6, devices_per_node=1, compute_efficiency=0.74,
                          bandwidth_efficiency=0.75, step_overhead_s=0.016)

HARDWARE_PRESETS: Mapping[str, Hardware] = MappingProxyType({hw.name: hw for hw in (
    _nvidia("a100-80gb", "NVIDIA A100 SXM4 80 GB", 312, None, 81920, 2.039, 600),
    _nvidia("h100-sxm", "NVIDIA H100 SXM5 80 GB", 989.4, 1978.9, 81559, 3.35, 900),
    # H800: the H100's compute and HBM, NVLink cut to 400 GB/s (export variant)
    _nvidia("h800-sxm", "NVIDIA H800 SXM5 80 GB", 989.4, 1978.9, 81559, 3.35, 400),
    _nvidia("h200", "NVIDIA H200 SXM 141 GB", 989.4, 1978.9, 143771, 4.8, 900),
    XEON_AMX_2VCPU,
)})


def hardware_preset(name: str) -> Hardware:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE_PRESETS)}") from None
