"""``MoE``: DeepSpeed's Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``)."""

from __future__ import annotations

import logging

from torch import Tensor, nn
from torch.nn import functional as F

from ds_moe import groups
from ds_moe._noise import check_noisy_gate_policy
from ds_moe.experts import Experts
from ds_moe.sharded_moe import MOELayer, TopKGate

logger = logging.getLogger(__name__)


def _check_sizes(num_experts: int, ep_size: int) -> None:
    for name, value in (("num_experts", num_experts), ("ep_size", ep_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
    if num_experts % ep_size:
        raise ValueError(f"Number of experts ({num_experts}) should be divisible by expert parallel size "
                         f"(ep_size={ep_size})")


class MoE(nn.Module):
    """A Mixture-of-Experts layer: ``num_experts`` copies of ``expert``, ``num_experts / ep_size`` on each rank.

    Arguments as DeepSpeed documents them (``k`` in {1, 2}; ``noisy_gate_policy`` in None, 'None', 'Jitter',
    'RSample'; ``drop_tokens=False`` is infinite capacity; ``use_residual`` makes it a Residual MoE: the
    output mixes the experts' with the dense ``expert`` through a learned 2-way softmax ``coefficient``).
    ``forward`` returns ``(output, l_aux, exp_counts)``; add ``l_aux`` (times a coefficient) to the loss.
    Expert parameters carry ``allreduce = False`` and ``group_name = expert_group_name`` (``"ep_size_<n>"``).
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_sizes(num_experts, ep_size)
        check_noisy_gate_policy(noisy_gate_policy)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{self.ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        logger.info("Creating MoE layer with num_experts: %d | num_local_experts: %d | expert_parallel_size: %d",
                    num_experts, self.num_local_experts, self.ep_size)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, self.ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # weights of (experts' output, mlp output)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (once per ``ep_size``) and attach this layer's expert-parallel process group."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            logger.info("No existing process group found, creating a new group named: %s", self.expert_group_name)
            if groups.mpu is None or not self.enable_expert_tensor_parallelism:
                groups._create_expert_and_data_parallel(
                    self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
            else:
                groups._create_expert_data_and_model_parallel(
                    self.ep_size, mpu=groups.mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden_states`` ``[..., hidden_size]`` -> ``(output, l_aux, exp_counts)``.

        ``used_token``: optional 0/1 mask over the flattened tokens; masked tokens are not routed (top-1).
        """
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]  # a (output, bias) expert: the bias is ignored, as DeepSpeed does
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


__all__ = ["MoE"]
