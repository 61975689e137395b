"""How long a KV transfer takes between a prefill and a decode worker: latency + bytes / bandwidth.

Presets are nominal line rates times a stated efficiency (what a well-tuned transfer engine
reaches: NCCL / Mooncake report 80-90% of line rate on large messages). The host presets were
measured between two processes of one host (`benchmarks/results/kv-transfer.md`: shm 3.9 GB/s, tcp
0.37 GB/s over loopback); give `--link-gbps` / `--link-latency-us` for another link.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.config import ConfigError


@dataclass(frozen=True)
class LinkModel:
    """One direction of a point-to-point link, as the KV transfer sees it."""

    name: str
    bandwidth_gbps: float  # effective, in gigabits per second
    latency_us: float  # per transfer: connection setup, the first byte, the completion notice

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or self.latency_us < 0:
            raise ConfigError(f"link {self.name!r}: bandwidth must be positive and latency non-negative")

    def transfer_seconds(self, num_bytes: int) -> float:
        return self.latency_us * 1e-6 + num_bytes * 8 / (self.bandwidth_gbps * 1e9)


def _preset(name: str, line_gbps: float, efficiency: float, latency_us: float) -> LinkModel:
    return LinkModel(name, line_gbps * efficiency, latency_us)


LINK_PRESETS: dict[str, LinkModel] = {link.name: link for link in (
    _preset("nvlink", 900 * 8, 0.8, 10.0),  # NVLink 4 (H100/H200): 900 GB/s aggregate
    _preset("ib400", 400, 0.85, 15.0),  # InfiniBand NDR, one HCA per GPU
    _preset("ib200", 200, 0.85, 15.0),  # InfiniBand HDR
    _preset("roce200", 200, 0.8, 25.0),  # RoCE v2, 200 Gbps
    _preset("pcie4", 32 * 8, 0.8, 10.0),  # PCIe 4.0 x16 via host memory
    _preset("tcp25", 25, 0.6, 100.0),  # a 25 GbE datacenter NIC through the kernel TCP stack
    LinkModel("host-shm", 31.0, 500.0),  # kvbaton's shm transport, two processes on one host
    LinkModel("host-tcp", 3.0, 1000.0),  # kvbaton's tcp transport over loopback
)}


def link_preset(name: str) -> LinkModel:
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown link {name!r}; choose one of {', '.join(LINK_PRESETS)}") from None
