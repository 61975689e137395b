"""What to simulate: the instances of a deployment, how requests reach them, and the requests.

An *instance* is what one kvbaton worker is: one engine (scheduler + KV pool) whose steps take
what its latency model says. On a GPU cluster an instance is a TP x PP group of GPUs; the latency
model and the pool size carry that (`kvbaton.sim.roofline`), the simulator does not care.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.config import ConfigError, SchedulerConfig
from kvbaton.sim.host import HostOverhead
from kvbaton.sim.latency import StepLatencyModel
from kvbaton.sim.links import LinkModel, link_preset


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """One worker: its step cost, its KV pool and its scheduler limits."""

    latency: StepLatencyModel
    num_blocks: int  # KV pool size, in blocks of `block_size` tokens
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    kv_bytes_per_token: int = 0  # what a KV transfer moves per prompt token (all layers, K and V)
    num_devices: int = 1  # GPUs (or CPU sockets) the instance occupies, for per-device figures

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_model_len < 1 or self.num_devices < 1:
            raise ConfigError("an instance needs at least one block, one token per block, and one device")

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The deployment: `num_decode` decode instances (colocated replicas when `num_prefill` is 0)
    and `num_prefill` prefill instances, routed as the real router does."""

    decode: InstanceSpec
    num_decode: int = 1
    prefill: InstanceSpec | None = None  # default: the same as `decode`
    num_prefill: int = 0
    link: LinkModel = field(default_factory=lambda: link_preset("host-shm"))
    # The KV of each layer leaves while later layers compute (kvbaton's prefill workers do), so only
    # what the link cannot hide behind the last prefill chunk adds to the handoff.
    layerwise_transfer: bool = True
    prefill_policy: str = "least_loaded"  # kvbaton.router.policies.POLICIES
    decode_policy: str = "least_loaded"
    local_prefill_threshold: int = 64  # prompts with fewer uncached tokens prefill on the decode instance
    max_waiting_requests: int = 256  # the server's admission control: refused (503) beyond this
    host: HostOverhead = field(default_factory=HostOverhead)  # what serving adds (none: the engines alone)

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ConfigError("a deployment needs at least one decode (or colocated) instance")

    @property
    def prefill_instance(self) -> InstanceSpec:
        return self.prefill or self.decode

    @property
    def num_devices(self) -> int:
        return self.num_decode * self.decode.num_devices + self.num_prefill * self.prefill_instance.num_devices

    @property
    def label(self) -> str:
        if self.num_prefill == 0:
            return "colocated" if self.num_decode == 1 else f"{self.num_decode} replicas"
        return f"{self.num_prefill}P+{self.num_decode}D"


@dataclass(frozen=True)
class SimRequest:
    """One request of the load: when it arrives, its prompt, and how many tokens it generates."""

    request_id: int
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
