"""AutoEP's token-choice top-k router: every token picks its ``top_k`` experts (DeepSpeed's ``ep_router``).

Scores are the gate's logits through softmax or sigmoid (in fp32). Expert choice may add a load-balancing
``expert_bias`` and DeepSeek-V3's ``e_score_correction_bias``, and may be group limited (experts split into
``num_expert_groups`` groups; a token considers only the best ``num_limited_groups`` groups, ranked by the best
expert or the sum of the best two). The returned weights are the unbiased scores of the chosen experts,
renormalised to sum 1 when ``route_norm``, times ``route_scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_moe.ep_count import count_tokens_per_expert

SCORE_FUNCS = ("softmax", "sigmoid")
GROUP_SCORE_FUNCS = ("max", "top2_sum")


class TokenChoiceTopKRouter(nn.Module):
    """``forward(x [T, dim], expert_bias=None) -> (top_scores [T, k], selected_experts [T, k],
    num_tokens_per_expert [num_experts] int32)``."""

    def __init__(self, dim: int, num_experts: int, num_expert_groups: int | None, num_limited_groups: int | None,
                 top_k: int, score_func: str, route_norm: bool, route_scale: float, gate_bias: bool,
                 group_score_func: str = "top2_sum") -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"TokenChoiceTopKRouter: score_func={score_func!r}; expected one of {SCORE_FUNCS}")
        if group_score_func not in GROUP_SCORE_FUNCS:
            raise ValueError(f"TokenChoiceTopKRouter: group_score_func={group_score_func!r}; expected one of "
                             f"{GROUP_SCORE_FUNCS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TokenChoiceTopKRouter: top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.group_score_func = group_score_func
        self.e_score_correction_bias: Tensor | None = None  # DeepSeek-V3's, copied from the source router

    def _limit_to_groups(self, scores: Tensor) -> Tensor:
        """``scores`` with the experts outside each token's ``num_limited_groups`` best groups set to -inf."""
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if limited is None or limited < 1:
            raise ValueError(f"num_limited_groups must be an integer >= 1 when num_expert_groups is set, got {limited}")
        if self.num_experts % groups:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by num_expert_groups ({groups})")
        per_group = self.num_experts // groups
        grouped = scores.view(-1, groups, per_group)
        if self.group_score_func == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            if per_group < 2:
                raise ValueError(f"group_score_func='top2_sum' needs >= 2 experts per group, got {per_group}")
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(limited, dim=-1, sorted=False).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)

    def forward(self, x: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=1)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.unsqueeze(0)
        if self.num_expert_groups is not None:
            choice = self._limit_to_groups(choice)
        selected = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, selected, count_tokens_per_expert(selected, self.num_experts)
