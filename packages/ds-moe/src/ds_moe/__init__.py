"""Mixture of Experts: the MoE layer, top-k gating, expert parallelism over explicit process groups, and AutoEP.

Public surface (DeepSpeed's ``deepspeed.moe`` names): :class:`MoE` (``layer``), :class:`TopKGate`,
:class:`MOELayer` and the gating functions (``sharded_moe``), :class:`Experts` (``experts``), the MoE
parameter helpers (``utils``) and the expert process groups (``groups``).
"""

from ds_moe import groups
from ds_moe.__about__ import __version__
from ds_moe.experts import Experts
from ds_moe.layer import MoE
from ds_moe.sharded_moe import (
    DISPATCH_MODES,
    MOELayer,
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)
from ds_moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)

__all__ = [
    "DISPATCH_MODES",
    "Experts",
    "MOELayer",
    "MoE",
    "TopKGate",
    "__version__",
    "configure_moe_param_groups",
    "groups",
    "gumbel_rsample",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "multiplicative_jitter",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
    "top1gating",
    "top2gating",
    "topkgating",
]
