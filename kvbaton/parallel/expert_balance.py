"""EPLB at run time: count each MoE layer's tokens per expert over a window, re-place the experts over the
expert-parallel ranks (replicating hot ones into the redundant slots), copy the moved experts' weights in the
background, and swap every layer's placement between two steps, on every rank in the same step.

    every step:  count ──▶ window (local)
    rebalance:   all-reduce the window (every rank sees the group's load) ─▶ EPLB plan (deterministic: every
                 rank computes the same one) ─▶ loader thread: the new local slots' weights (kept ones copied,
                 moved ones read from the checkpoint)
    every step:  all ranks' weights ready? (in the step's agreement) ─▶ swap, before that step's forward
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvbaton.config import ExpertParallelConfig, MoEConfig
from kvbaton.layers.moe.dispatch import AllToAllDispatch, ExpertMap, restacked
from kvbaton.layers.moe.eplb import ExpertPlacement, Objective, rebalance, rebalance_layer
from kvbaton.layers.moe.experts import GroupedExperts
from kvbaton.layers.moe.load_stats import ExpertLoadWindow
from kvbaton.parallel.expert_stats import MoELayer

# (model layer index, logical experts in slot order) -> (gate_up [n, 2I, H], down [n, H, I]) from the checkpoint
ReadExperts = Callable[[int, list[int]], tuple[torch.Tensor, torch.Tensor]]


class ExpertRebalancer:
    def __init__(self, layers: list[MoELayer], window: ExpertLoadWindow, moe: MoEConfig, config: ExpertParallelConfig,
                 group: dist.ProcessGroup, read_experts: ReadExperts) -> None:
        self.layers, self.window, self.moe, self.config, self.group = layers, window, moe, config, group
        self.rank = dist.get_rank(group)
        self._read = read_experts
        self._objective: Objective = "active_experts" if config.balance_objective == "active_experts" else "tokens"
        uniform = [1.0] * moe.num_experts  # before any load is known: spread the redundant slots evenly
        first = rebalance_layer(uniform, **self._shape())
        self.placements: list[ExpertPlacement] = [first] * len(layers)
        self._planned: list[ExpertPlacement] | None = None
        self._weights: list[GroupedExperts] = []
        self._loader: threading.Thread | None = None
        self._error: BaseException | None = None
        self.rebalances = 0

    def _shape(self) -> dict:
        return dict(num_replicas=self.moe.num_experts + self.config.num_redundant_experts,
                    num_groups=self.moe.num_groups, num_nodes=1, num_ranks=self.config.size, objective=self._objective)

    def expert_map(self, layer: int) -> ExpertMap:
        return ExpertMap(self.placements[layer].physical_to_logical, self.config.size)

    # ---- statistics ----------------------------------------------------------------------------

    def group_load(self) -> list[list[int]]:
        """The window's counts summed over every rank (a collective: every rank calls it in the same step)."""
        totals = torch.tensor(self.window.totals(), dtype=torch.int64)
        dist.all_reduce(totals, group=self.group)
        return totals.tolist()

    # ---- rebalancing ---------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return self._planned is not None

    def begin(self) -> None:
        """Plan from the group's load and start copying this rank's new slots' weights (collective)."""
        if self.pending:
            return
        self._planned = rebalance(self.group_load(), self.placements, **self._shape())
        self._loader = threading.Thread(target=self._load_weights, args=(self._planned,), daemon=True,
                                        name="eplb-weights")
        self._loader.start()

    def weights_ready(self) -> bool:
        if self._error is not None:
            raise RuntimeError(f"copying the rebalanced experts' weights failed: {self._error}") from self._error
        return self._loader is not None and not self._loader.is_alive()

    def apply(self) -> None:
        """Swap every layer to the planned placement (every rank in the same step, before its forward)."""
        assert self._planned is not None and self.weights_ready()
        for layer, placement, experts in zip(self.layers, self._planned, self._weights):
            dispatcher = layer.block.dispatcher
            assert isinstance(dispatcher, AllToAllDispatch)
            expert_map = ExpertMap(placement.physical_to_logical, self.config.size)
            layer.block.experts = experts
            dispatcher.swap(experts, expert_map)
        self.placements, self._planned, self._weights, self._loader = self._planned, None, [], None
        self.rebalances += 1

    def _load_weights(self, planned: list[ExpertPlacement]) -> None:
        try:
            self._weights = [self._layer_experts(layer, old, new) for layer, old, new
                             in zip(self.layers, self.placements, planned)]
        except BaseException as exc:  # noqa: BLE001 - surfaced by weights_ready on the engine's thread
            self._error = exc

    def _layer_experts(self, layer: MoELayer, old: ExpertPlacement, new: ExpertPlacement) -> GroupedExperts:
        per = new.slots_per_rank
        mine = slice(self.rank * per, (self.rank + 1) * per)
        return restacked(layer.block.experts, old.physical_to_logical[mine], new.physical_to_logical[mine],
                         functools.partial(self._read, layer.index))


    # ---- what it looks like ----------------------------------------------------------------------

    def balancedness(self, load: list[list[int]]) -> list[float]:
        """Per layer, mean / max tokens per rank under the current placement for `load`."""
        return [p.balancedness(row) for p, row in zip(self.placements, load)]
