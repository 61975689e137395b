"""The routed experts of one MoE layer, computed grouped: each hit expert runs once over all its tokens.

    assignments (token, k-th choice) ──sort by expert──▶ | e0: t3 t9 | e2: t1 | e5: t0 t3 t4 | ...
                                                          one gate_up GEMM, silu*up, one down GEMM per run
    combine: each row times its routing weight, added into its token's output (one index_add_)

Weights are stacked per layer: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (the loader stacks a
checkpoint's per-expert matrices), so a group's GEMM reads one expert's weights contiguously.

Two ways to compute it: PyTorch (a loop over the hit experts, above), or, where the engine's compute plan
attaches it (`use_kernel`, bf16 models), kvbaton's C kernel (kvbaton/kernels/moe_experts.c): one call per
layer that sorts, runs every hit expert over its rows and combines, over the same parameters rewritten in
place into the kernel's packed layout (from then on only the kernel can read them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.kernels.moe import MoEExpertsKernel


class ExpertGroups:
    """A step's assignments: each token's k expert ids and routing weights ([T, k]) and the assignments per
    expert (`counts`, [E] int64). Sorted by expert on first use (`tokens`, `weights`, `runs`): row r of the
    sorted batch is token `tokens[r]`'s choice; the C kernel sorts them itself, so its steps never do here."""

    def __init__(self, ids: torch.Tensor, choice_weights: torch.Tensor, counts: torch.Tensor) -> None:
        self.ids = ids  # [T, k] expert of each choice
        self.choice_weights = choice_weights  # [T, k] its routing weight
        self.counts = counts

    @classmethod
    def of(cls, ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups:
        return cls(ids, weights, torch.bincount(ids.flatten(), minlength=num_experts))

    @functools.cached_property
    def _order(self) -> torch.Tensor:
        # NOTE: stable, so within an expert tokens keep their order and each token's contributions are
        # summed in expert order, as transformers' per-expert loop sums them (bitwise fp32 parity).
        return torch.argsort(self.ids.flatten(), stable=True)

    @property
    def tokens(self) -> torch.Tensor:
        """[N] token index of each sorted assignment (N = T * k)."""
        return self._order // self.ids.shape[1]

    @property
    def weights(self) -> torch.Tensor:
        """[N] routing weight of each sorted assignment."""
        return self.choice_weights.flatten()[self._order]

    def runs(self) -> list[tuple[int, int, int]]:
        """(expert, first row, rows) of every expert with tokens; experts nobody chose cost nothing."""
        hit = torch.nonzero(self.counts).flatten().tolist()
        counts = self.counts.tolist()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        return [(e, starts[e], counts[e]) for e in hit]


class GroupedExperts(nn.Module):
    # the C kernel, over gate_up_proj / down_proj packed in place for it (`use_kernel`, apply_compute_plan)
    kernel: MoEExpertsKernel | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def use_kernel(self, kernel: MoEExpertsKernel) -> None:
        """Compute through `kernel` from now on: packs the weights into its layout, in place (no copy kept,
        so there is no going back to the PyTorch loop for this module)."""
        if self.kernel is not None:
            raise RuntimeError("these experts' weights are packed for a kernel already")
        kernel.pack_(self.gate_up_proj.data, self.down_proj.data)
        self.kernel = kernel

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """x: [T, H] -> [T, H], the weighted sum of each token's chosen experts."""
        if self.kernel is not None:
            return self.kernel(x, groups.ids, groups.choice_weights, self.gate_up_proj, self.down_proj)
        tokens = groups.tokens
        rows = x.index_select(0, tokens)  # [N, H]
        out = torch.empty_like(rows)
        for expert, start, n in groups.runs():
            out[start:start + n] = self.expert_forward(expert, rows[start:start + n])
        out.mul_(groups.weights.to(out.dtype).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[expert]).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])
