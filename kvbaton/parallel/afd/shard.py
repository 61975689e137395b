"""An expert worker's experts: its slots of every MoE layer's routed experts, read from the checkpoint, and the
computation a dispatched row asks of them (the row through its slot's expert, weight 1: the attention worker
that sent it weights and sums, `layers.moe.dispatch.combine`).

The pool's placement is the expert-parallel one (`ExpertMap`: slot s on expert worker s // slots_per_worker):
contiguous, E / size experts a worker, and with `redundant` slots, copies of the next workers' experts
(`ExpertMap.mirrored`), which an attention worker routes to while their first owner is down."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.layers.compute_paths import moe_kernel_of, plan_compute
from kvbaton.layers.moe.dispatch import ExpertMap, stacked_experts
from kvbaton.layers.moe.experts import ExpertGroups, GroupedExperts
from kvbaton.models.loader import read_experts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    """Which expert worker of the pool this is, and over what model."""

    model_dir: Path
    rank: int
    size: int
    dtype: torch.dtype = torch.float32
    kernels: bool = True  # bf16: compute through the C experts kernel where the CPU has one
    compute_path: str = "auto"  # the engine's --compute-path (its experts' kernel follows it)
    deterministic: bool = False  # batch-invariant kernels, as the attention workers' engines
    redundant: int = 0  # the pool's redundant expert slots (a multiple of size): copies of other workers' experts


class ExpertShard:
    def __init__(self, spec: ShardSpec) -> None:
        cfg = ModelConfig.from_dir(spec.model_dir)
        if cfg.moe is None:
            raise ConfigError(f"{spec.model_dir} has no sparse-expert (MoE) layers: nothing for an expert worker")
        self.spec = spec
        self.hidden, self.num_experts = cfg.hidden_size, cfg.moe.num_experts
        try:
            self.map = ExpertMap.mirrored(self.num_experts, spec.size, spec.redundant)
        except ValueError as exc:
            raise ConfigError(f"expert pool of {spec.size}: {exc}") from exc
        self.slots = self.map.local_experts(spec.rank)
        self.layers: dict[int, GroupedExperts] = {}
        kernel = moe_kernel_of(plan_compute(spec.dtype, spec.compute_path, spec.deterministic, spec.kernels)) \
            if spec.kernels else None
        for layer in range(cfg.num_hidden_layers):
            if cfg.moe.is_moe_layer(layer):
                experts = stacked_experts(*read_experts(spec.model_dir, layer, self.slots, spec.dtype))
                if kernel is not None and kernel.supports(experts.gate_up_proj, experts.down_proj):
                    experts.use_kernel(kernel)
                self.layers[layer] = experts
        self.rows_computed = 0
        logger.info("expert worker %d/%d: experts %s of %d MoE layers (%s)", spec.rank, spec.size, self.slots,
                    len(self.layers), "C kernel" if kernel is not None else "PyTorch")

    @property
    def dtype_name(self) -> str:
        return str(self.spec.dtype).removeprefix("torch.")

    def compute(self, layer: int, rows: torch.Tensor, local_slots: torch.Tensor) -> torch.Tensor:
        """rows [n, hidden] through the experts of `local_slots` [n] (int64, each < len(slots)) of `layer`."""
        experts = self.layers[layer]
        if rows.shape[0] == 0:
            return rows
        self.rows_computed += rows.shape[0]
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32)
        return experts(rows, ExpertGroups.of(local_slots.unsqueeze(1), ones, len(self.slots)))
