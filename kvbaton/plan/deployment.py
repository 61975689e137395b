"""One configuration to try: TP x PP per instance, dtypes, scheduler limits, colocated or a P:D unit.

A *unit* is what the plan replicates: one colocated instance, or `num_prefill` prefill instances with
`num_decode` decode instances. The simulator runs one unit at its share of the load, which is exact for
replicas that share nothing (the router spreads requests evenly) and saves simulating the whole fleet.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvbaton.config import ConfigError, SchedulerConfig
from kvbaton.plan.memory import MemoryPlan, plan_memory
from kvbaton.sim.hardware import Hardware
from kvbaton.sim.links import LinkModel, link_preset
from kvbaton.sim.model_spec import Dtype, KVDtype, ModelSpec
from kvbaton.sim.roofline import Parallelism, RooflineLatency
from kvbaton.sim.spec import ClusterSpec, InstanceSpec

# NOTE: vLLM's long-standing max_num_seqs default, and the 8192-token step budget its V1 engine uses on
# H100-class GPUs: enough prefill per step to reach good MFU, small enough that one step's prefill does not
# blow the decodes' TPOT.
DEFAULT_SCHEDULER = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)


@dataclass(frozen=True, kw_only=True)
class DeploymentPlan:
    parallel: Parallelism
    weight_dtype: Dtype = Dtype.BF16
    kv_dtype: KVDtype = KVDtype.BF16
    scheduler: SchedulerConfig = DEFAULT_SCHEDULER
    num_prefill: int = 0  # per unit; 0: colocated
    num_decode: int = 1
    local_prefill_threshold: int = 64  # PD: prompts with fewer uncached tokens prefill on the decode instance
    gpu_memory_utilization: float = 0.9
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError("a unit needs at least one decode (or colocated) instance")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def unit_devices(self) -> int:
        return (self.num_prefill + self.num_decode) * self.parallel.num_devices

    @property
    def label(self) -> str:
        mode = f" {self.num_prefill}P:{self.num_decode}D" if self.disaggregated else ""
        if self.disaggregated and self.local_prefill_threshold > 64:
            mode += f" (local < {self.local_prefill_threshold})"
        return f"{self.parallel.label}{mode}"

    def with_(self, **changes: object) -> DeploymentPlan:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What every deployment of one plan shares: the model, the device, the links."""

    model: ModelSpec
    hardware: Hardware
    kv_link: LinkModel = field(default_factory=lambda: link_preset("roce200"))  # P -> D, between nodes
    max_model_len: int = 8192

    def memory(self, dep: DeploymentPlan) -> MemoryPlan:
        return plan_memory(self.model, self.hardware, dep.parallel, weight_dtype=dep.weight_dtype,
                           kv_dtype=dep.kv_dtype, scheduler=dep.scheduler,
                           gpu_memory_utilization=dep.gpu_memory_utilization, block_size=dep.block_size)

    def latency(self, dep: DeploymentPlan) -> RooflineLatency:
        return RooflineLatency(model=self.model, hardware=self.hardware, parallel=dep.parallel,
                               weight_dtype=dep.weight_dtype, kv_dtype=dep.kv_dtype, inter_node_link=self.kv_link)

    def instance(self, dep: DeploymentPlan) -> InstanceSpec:
        memory = self.memory(dep)
        if memory.num_blocks < 1:
            raise ConfigError(f"{dep.label}: {self.model.name} does not fit on {self.hardware.name}")
        return InstanceSpec(latency=self.latency(dep), num_blocks=memory.num_blocks, block_size=dep.block_size,
                            scheduler=dep.scheduler, max_model_len=self.max_model_len,
                            kv_bytes_per_token=memory.kv_bytes_per_token, num_devices=dep.parallel.num_devices)

    def cluster(self, dep: DeploymentPlan) -> ClusterSpec:
        """One unit of `dep`, as the simulator runs it."""
        instance = self.instance(dep)
        return ClusterSpec(decode=instance, num_decode=dep.num_decode, num_prefill=dep.num_prefill,
                           link=self.kv_link, local_prefill_threshold=dep.local_prefill_threshold)
