"""The routed experts of one MoE layer, computed grouped: each hit expert runs once over all its tokens.

    assignments (token, k-th choice) ──sort by expert──▶ | e0: t3 t9 | e2: t1 | e5: t0 t3 t4 | ...
                                                          one gate_up GEMM, silu*up, one down GEMM per run
    combine: each row times its routing weight, added into its token's output (one index_add_)

Weights are stacked per layer: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (the loader stacks a
checkpoint's per-expert matrices), so a group's GEMM reads one expert's weights contiguously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ExpertGroups:
    """A step's assignments sorted by expert: row r of the sorted batch is token `tokens[r]`'s choice."""

    tokens: torch.Tensor  # [N] token index of each sorted assignment (N = T * k)
    weights: torch.Tensor  # [N] its routing weight
    counts: torch.Tensor  # [E] assignments per expert (int64)

    @classmethod
    def of(cls, ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups:
        flat = ids.flatten()
        # NOTE: stable, so within an expert tokens keep their order and each token's contributions are
        # summed in expert order, as transformers' per-expert loop sums them (bitwise fp32 parity).
        order = torch.argsort(flat, stable=True)
        return cls(tokens=order // ids.shape[1], weights=weights.flatten()[order],
                   counts=torch.bincount(flat, minlength=num_experts))

    def runs(self) -> list[tuple[int, int, int]]:
        """(expert, first row, rows) of every expert with tokens; experts nobody chose cost nothing."""
        hit = torch.nonzero(self.counts).flatten().tolist()
        counts = self.counts.tolist()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        return [(e, starts[e], counts[e]) for e in hit]


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """x: [T, H] -> [T, H], the weighted sum of each token's chosen experts."""
        rows = x.index_select(0, groups.tokens)  # [N, H]
        out = torch.empty_like(rows)
        for expert, start, n in groups.runs():
            out[start:start + n] = self.expert_forward(expert, rows[start:start + n])
        out.mul_(groups.weights.to(out.dtype).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, groups.tokens, out)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[expert]).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])
