"""A roofline step-latency model: what one step of a TP x PP instance of a model costs on a hardware preset.

  step = max(compute, memory) + communication + overhead
  compute        FLOPs / (tp x achieved FLOP/s): 2 x active matmul params per token, the LM head for each
                 sequence's last token, QK^T + PV per attended position
  memory         bytes per GPU / achieved bandwidth: the weights once per step (for MoE only the experts the
                 step's tokens hit: E x (1 - (1 - k/E)^N) of E for N tokens choosing k), the KV the decoding
                 sequences attend to, and the KV the step writes
  communication  TP: two ring all-reduces per layer (2(tp-1)/tp x tokens x hidden x 2 bytes over the link, plus
                 a per-call latency); EP: a dispatch and a combine all-to-all per MoE layer; PP: one hop per
                 stage boundary

Pipeline parallelism is modelled without micro-batch overlap: a step runs through the pp stages one after
another, so its latency is the sum of the stages (each holding 1/pp of the layers on tp GPUs) plus pp-1 hops.
That is the latency a request sees, and a conservative throughput: an engine that keeps pp micro-batches in
flight gets up to pp times more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.config import ConfigError
from kvbaton.sim.hardware import Hardware
from kvbaton.sim.latency import StepShape
from kvbaton.sim.links import LinkModel
from kvbaton.sim.model_spec import Dtype, KVDtype, ModelSpec

ACTIVATION_BYTES = 2  # bf16 activations on the wire (all-reduce, all-to-all, PP hops)


@dataclass(frozen=True)
class Parallelism:
    """How one instance spreads a model: `tp` GPUs per pipeline stage, `pp` stages.

    ep = 1: experts are tensor-parallel like the rest. ep = tp: each stage's GPUs hold 1/ep of the experts
    whole, and attention runs data-parallel over them (each GPU its own sequences, the non-expert weights
    replicated), as DeepSeek-V3 is deployed; tokens cross GPUs by all-to-all in each MoE layer."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep) < 1:
            raise ConfigError("tp, pp and ep must be at least 1")
        if self.ep not in (1, self.tp):
            raise ConfigError(f"ep must be 1 or equal to tp ({self.tp}): experts spread over one stage's GPUs")

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp

    @property
    def attention_dp(self) -> bool:
        return self.ep > 1

    @property
    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp}" + (f" EP{self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class StepCosts:
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s


def expected_experts_hit(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Distinct experts N tokens hit when each picks k of E uniformly: E x (1 - (1 - k/E)^N)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True, kw_only=True)
class RooflineLatency:
    """StepLatencyModel of one instance (tp x pp GPUs of `hardware`); see the module docstring."""

    model: ModelSpec
    hardware: Hardware
    parallel: Parallelism = field(default_factory=Parallelism)
    weight_dtype: Dtype = Dtype.BF16
    kv_dtype: KVDtype = KVDtype.BF16
    inter_node_link: LinkModel | None = None  # PP hops between nodes when an instance spans more than one

    def __post_init__(self) -> None:
        if self.parallel.ep > 1 and self.model.moe is None:
            raise ConfigError(f"ep={self.parallel.ep} needs an MoE model; {self.model.name} is dense")
        if self.parallel.tp > self.hardware.devices_per_node:
            raise ConfigError(f"TP{self.parallel.tp} exceeds a node of {self.hardware.devices_per_node} "
                              f"{self.hardware.name} devices: tensor parallelism stays inside a node")

    @property
    def name(self) -> str:
        return (f"roofline {self.model.name} {self.parallel.label} {self.hardware.name} "
                f"{self.weight_dtype.value}/kv {self.kv_dtype.value}")

    def step_seconds(self, shape: StepShape) -> float:
        return self.costs(shape).total_s

    def costs(self, shape: StepShape) -> StepCosts:
        hw = self.hardware
        compute = self.step_flops(shape) / (self.parallel.tp * hw.achieved_flops(self.weight_dtype))
        memory = self.step_bytes_per_device(shape) / hw.achieved_bandwidth
        return StepCosts(compute, memory, self._comm_seconds(shape.num_tokens), hw.step_overhead_s)

    def step_flops(self, shape: StepShape) -> float:
        m = self.model
        logit_rows = shape.prefill_seqs + shape.decode_seqs
        return (2.0 * m.matmul_params_per_token * shape.num_tokens + 2.0 * m.lm_head_params * logit_rows
                + shape.prefill_attended * m.attention_flops_per_position(decode=False)
                + shape.decode_context * m.attention_flops_per_position(decode=True))

    def step_bytes_per_device(self, shape: StepShape) -> float:
        """Bytes one GPU of each stage reads and writes, summed over the stages (which run one after another)."""
        return self._weight_bytes(shape.num_tokens) + self._kv_bytes(shape)

    def kv_bytes_per_token_per_device(self) -> float:
        """One token's KV on one GPU: 1/pp of the layers, 1/tp of the KV heads, where TP can split them (MLA's
        latent, or more GPUs than KV heads, are replicated; attention-DP gives each GPU whole sequences)."""
        tp = self.parallel.tp
        shards = tp if self.parallel.attention_dp else min(tp, self.model.kv_shards)
        return self.model.kv_bytes_per_token(self.kv_dtype) / (shards * self.parallel.pp)

    def _weight_bytes(self, num_tokens: int) -> float:
        m, p = self.model, self.parallel
        untied_embedding = 0 if m.tie_word_embeddings else m.embedding_params  # only looked-up rows are read
        shared = (m.shared_params - untied_embedding) / (1 if p.attention_dp else p.tp)
        experts = 0.0
        if m.moe is not None and num_tokens > 0:
            hit = expected_experts_hit(m.moe.num_experts, m.moe.top_k, num_tokens)
            experts = m.num_moe_layers * hit * m.expert_params / p.tp
        return (shared + experts) * self.weight_dtype.bytes

    def _kv_bytes(self, shape: StepShape) -> float:
        # NOTE: the decode context is read once per step; prefill re-reads its prefix once per query tile,
        # which compute dominates, so only the KV a step writes is counted for prefill tokens
        per_device = self.kv_bytes_per_token_per_device() * self.parallel.pp  # summed over the stages
        return (shape.decode_context + shape.num_tokens) * per_device

    def _comm_seconds(self, num_tokens: int) -> float:
        if num_tokens == 0:
            return 0.0
        m, p, hw = self.model, self.parallel, self.hardware
        message = num_tokens * m.hidden_size * ACTIVATION_BYTES
        link = hw.achieved_link_bandwidth
        seconds = 0.0
        if p.attention_dp:
            # dispatch + combine: each GPU sends its tokens' top-k copies to the other ranks
            sent = message / p.ep * (m.moe.top_k if m.moe else 1) * (p.ep - 1) / p.ep
            seconds += m.num_moe_layers * 2 * (sent / link + hw.link_latency_s)
        elif p.tp > 1:
            ring = 2 * (p.tp - 1) / p.tp * message / link + hw.link_latency_s
            seconds += 2 * m.num_layers * ring
        if p.pp > 1:
            seconds += (p.pp - 1) * self._hop_seconds(message)
        return seconds

    def _hop_seconds(self, message: float) -> float:
        spans_nodes = self.parallel.num_devices > self.hardware.devices_per_node
        if spans_nodes and self.inter_node_link is not None:
            return self.inter_node_link.transfer_seconds(int(message))
        return message / self.hardware.achieved_link_bandwidth + self.hardware.link_latency_s
