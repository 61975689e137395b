"""The MoE gate: score every expert for every token, keep the top k, and say how much each counts.

Two families of routing, as `MoEConfig.scoring` names them:
- softmax (Mixtral, Qwen-MoE, OLMoE): softmax over all experts, top k, renormalized over the k when
  `norm_topk_prob`;
- sigmoid (DeepSeek-V3, Kimi-K2): sigmoid scores; the *choice* adds `e_score_correction_bias` and keeps only
  the `topk_groups` best of `num_groups` expert groups (a group scores by its two best experts), while the
  *weights* are the plain sigmoid scores of the chosen, renormalized, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbaton.config import MoEConfig
from kvbaton.kernels.moe import MoERouteKernel


class TopKGate(nn.Module):
    # softmax scoring of a bf16 model in one C call (kvbaton/kernels/moe_experts.c), set by apply_compute_plan
    kernel: MoERouteKernel | None = None

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        # NOTE: a parameter (not a buffer) so the loader fills it from the checkpoint like any weight.
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32))
                                        if moe.score_correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        if self.moe.scoring == "sigmoid":
            return self._sigmoid_grouped(F.linear(x.float(), self.weight.float()))
        if self.kernel is not None and x.dtype == torch.bfloat16 and self.kernel.handles_rows(x):
            return self.kernel(x, self.weight, self.moe.top_k, self.moe.norm_topk_prob)
        return self._softmax(F.linear(x, self.weight).float())

    def _softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def _sigmoid_grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        scores = logits.sigmoid()  # [T, E]
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if moe.topk_groups < moe.num_groups:
            grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)  # [T, G, E/G]
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
            best_groups = group_scores.topk(moe.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # [T, G]
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * moe.routed_scaling_factor, ids
