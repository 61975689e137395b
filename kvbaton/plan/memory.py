"""What fits on one GPU of an instance: weights, the activation reserve, and the KV pool in what is left.

  usable    = device memory x gpu_memory_utilization (vLLM's knob: the engine takes that share up front)
  weights   = the model's bytes / (tp x pp), or with attention-DP (ep = tp) the non-expert weights / pp
              replicated on every GPU of a stage plus 1/(ep x pp) of the experts
  reserve   = the runtime (Hardware.reserved_bytes) + the peak activations of a full token-budget step
  KV pool   = usable - weights - reserve; every GPU holds its share of every token (its layers, its KV heads),
              so an instance holds KV pool / (one token's bytes on one GPU) tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbaton.config import SchedulerConfig
from kvbaton.sim.hardware import Hardware
from kvbaton.sim.model_spec import Dtype, KVDtype, ModelSpec
from kvbaton.sim.roofline import ACTIVATION_BYTES, Parallelism, RooflineLatency

LOGIT_BYTES = 4  # fp32 logits, one row per scheduled sequence


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """One GPU's memory, and the KV pool it gives its instance."""

    parallel: Parallelism
    device_bytes: int
    usable_bytes: float
    weight_bytes: float  # per GPU
    reserve_bytes: float  # per GPU
    kv_pool_bytes: float  # per GPU; <= 0 when the weights do not fit
    kv_bytes_per_token: int  # one token, the whole model
    kv_bytes_per_token_per_device: float
    block_size: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the instance's KV pool holds (whole blocks)."""
        return self.num_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        if self.kv_pool_bytes <= 0:
            return 0
        return int(self.kv_pool_bytes // self.kv_bytes_per_token_per_device) // self.block_size

    @property
    def kv_pool_bytes_per_instance(self) -> float:
        return max(self.kv_pool_bytes, 0.0) * self.parallel.num_devices

    def max_seqs(self, seq_len: int) -> int:
        """Sequences of `seq_len` tokens the pool holds at once (each takes whole blocks)."""
        return self.num_blocks // math.ceil(seq_len / self.block_size)

    def fits(self, max_seq_len: int) -> bool:
        """The weights fit and the pool holds at least one longest sequence."""
        return self.max_seqs(max_seq_len) >= 1


def activation_bytes(model: ModelSpec, parallel: Parallelism, scheduler: SchedulerConfig) -> float:
    """Peak activations of one step of `max_num_batched_tokens` tokens on one GPU: the residual stream and its
    normed copy, q/k/v and attention output, the MLP's gate and up, and the sequences' fp32 logits."""
    tp = 1 if parallel.attention_dp else parallel.tp
    moe = model.moe
    mlp = model.intermediate_size if moe is None else max(model.intermediate_size,
                                                          moe.top_k * moe.moe_intermediate_size)
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = 3 * model.hidden_size + (qkv + 2 * mlp) / tp
    logits = scheduler.max_num_seqs * model.vocab_size / tp * LOGIT_BYTES
    return scheduler.max_num_batched_tokens * per_token * ACTIVATION_BYTES + logits


def weight_bytes_per_device(model: ModelSpec, parallel: Parallelism, dtype: Dtype) -> float:
    if not parallel.attention_dp:
        return model.weight_bytes(dtype) / parallel.num_devices
    shared = model.shared_params / parallel.pp
    experts = model.routed_expert_params / (parallel.ep * parallel.pp)
    return (shared + experts) * dtype.bytes


def plan_memory(model: ModelSpec, hardware: Hardware, parallel: Parallelism, *, weight_dtype: Dtype,
                kv_dtype: KVDtype, scheduler: SchedulerConfig, gpu_memory_utilization: float = 0.9,
                block_size: int = 16) -> MemoryPlan:
    latency = RooflineLatency(model=model, hardware=hardware, parallel=parallel, weight_dtype=weight_dtype,
                              kv_dtype=kv_dtype)
    usable = hardware.memory_bytes * gpu_memory_utilization
    weights = weight_bytes_per_device(model, parallel, weight_dtype)
    reserve = hardware.reserved_bytes + activation_bytes(model, parallel, scheduler)
    return MemoryPlan(parallel=parallel, device_bytes=hardware.memory_bytes, usable_bytes=usable,
                      weight_bytes=weights, reserve_bytes=reserve, kv_pool_bytes=usable - weights - reserve,
                      kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype),
                      kv_bytes_per_token_per_device=latency.kv_bytes_per_token_per_device(), block_size=block_size)
