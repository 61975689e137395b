"""A sparse MoE layer in place of the dense MLP: route, run the chosen experts, add the shared expert."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvbaton.config import MoEConfig
from kvbaton.layers.linear import Linear
from kvbaton.layers.mlp import MLP
from kvbaton.layers.moe.dispatch import (
    AllToAllDispatch,
    ExpertDispatcher,
    ExpertMap,
    shard_experts,
    stacked_experts,
)
from kvbaton.layers.moe.experts import ExpertGroups, GroupedExperts
from kvbaton.layers.moe.gate import TopKGate


class SparseMoeBlock(nn.Module):
    """`forward(x [T, H]) -> [T, H]`; also counts, per expert, the tokens routed to it (`expert_token_counts`,
    summed until the caller takes them with `take_token_counts`: the load statistics EPLB plans from)."""

    expert_token_counts: torch.Tensor
    # set by `use_expert_parallel` (the experts live on several ranks) or by an attention worker (they live in its
    # expert pool): the routed experts are computed through it
    dispatcher: ExpertDispatcher | None = None

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = TopKGate(hidden_size, moe)
        self.experts = GroupedExperts(moe.num_experts, hidden_size, moe.intermediate_size)
        shared = moe.shared_intermediate_size
        self.shared_experts = MLP(hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.register_buffer("expert_token_counts", torch.zeros(moe.num_experts, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatcher is not None:
            return self.end(x, self.begin(x))
        weights, ids = self.gate(x)  # [T, k] each
        groups = ExpertGroups.of(ids, weights, self.moe.num_experts)
        self.expert_token_counts += groups.counts
        return self._add_shared(x, self.experts(x, groups))

    def begin(self, x: torch.Tensor) -> Any:
        """Route x and send its rows to the dispatcher's experts; `end` takes the outputs back (a micro-batched
        step computes another micro-batch in between)."""
        assert self.dispatcher is not None, "only a block whose experts are elsewhere splits its forward"
        weights, ids = self.gate(x)
        self.expert_token_counts += torch.bincount(ids.flatten(), minlength=self.moe.num_experts)
        return self.dispatcher.post(x, ids, weights)

    def end(self, x: torch.Tensor, pending: Any) -> torch.Tensor:
        assert self.dispatcher is not None
        return self._add_shared(x, self.dispatcher.wait(pending))

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out += shared
        return out

    def take_token_counts(self) -> torch.Tensor:
        """Tokens per expert since the last call ([E] int64), and start counting afresh."""
        counts = self.expert_token_counts.clone()
        self.expert_token_counts.zero_()
        return counts

    def use_expert_parallel(self, group: dist.ProcessGroup, expert_map: ExpertMap, int8_wire: bool = False) -> None:
        """Keep only this rank's expert slots and exchange tokens with the other ranks of `group`."""
        self.experts = shard_experts(self.experts, expert_map, dist.get_rank(group))
        self.dispatcher = AllToAllDispatch(self.experts, expert_map, self.moe.num_experts, group, int8_wire)

    def use_remote_experts(self, dispatcher: ExpertDispatcher) -> None:
        """The routed experts live elsewhere (an attention worker's expert pool): free their weights here and
        compute them through `dispatcher`."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        self.experts = stacked_experts(gate_up.new_empty(0, *gate_up.shape[1:]), down.new_empty(0, *down.shape[1:]))
        self.dispatcher = dispatcher

    def idle_exchange(self, hidden_size: int, dtype: torch.dtype) -> None:
        """A step in which this rank has no tokens: still take part in the layer's exchanges."""
        if self.dispatcher is not None:
            self.dispatcher.idle_exchange(hidden_size, dtype)
