"""MoE in the engine (``ds_moe``): expert process groups, optimizer parameter groups, and the gradient reducer that
averages expert parameters over their expert-data-parallel group.

Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_<n>"`` (``ds_moe.experts.Experts``);
``set_deepspeed_parallelism()`` on every MoE layer creates the groups (the same calls on every rank, in module
order). Imported only for models that contain MoE layers.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.grad_reduce import BucketedAllReduce, GroupedReducer, ReduceOptions
from ds_config import ConfigError


class MoEWithZeroStage3(ConfigError, AssertionError):
    """MoE layers with ``zero_optimization.stage`` 3: a ``ConfigError`` naming the key, and the ``AssertionError``
    DeepSpeed's engine raises for native MoE under ZeRO-3."""


def has_moe(module: torch.nn.Module) -> bool:
    """Whether ``module`` contains a DeepSpeed MoE layer or expert parameters (AutoEP layers)."""
    import sys

    if "ds_moe" not in sys.modules:  # no MoE layer can exist without ds_moe imported
        return False
    from ds_moe.utils import has_moe_layers, is_moe_param

    return has_moe_layers(module)[0] or any(is_moe_param(p) for p in module.parameters())


def configure(module: torch.nn.Module, mpu: Any, use_data_before_expert_parallel: bool = False) -> None:
    """Create the expert groups of every MoE layer of ``module`` (collective: every rank, same order)."""
    from ds_moe import groups

    if mpu is not None:
        groups.mpu = mpu
    for sub in module.modules():
        setup = getattr(sub, "set_deepspeed_parallelism", None)
        if callable(setup):
            setup(use_data_before_expert_parallel)


def broadcast_module(module: torch.nn.Module, dp_group: Any) -> None:
    """Rank 0's weights on every data-parallel rank, except experts: each expert's weights come from the first rank of
    its expert-data-parallel group (the ranks holding the same experts)."""
    import torch.distributed as dist

    from deepspeed.runtime.engine._module import broadcast_module as broadcast_shared
    from ds_moe import groups
    from ds_moe.utils import is_moe_param

    if not dist.is_initialized():
        return
    shared = [p for p in module.parameters() if not is_moe_param(p)]
    broadcast_shared(module, dp_group, params=shared)
    with torch.no_grad():
        for p in module.parameters():
            if is_moe_param(p) and groups._get_expert_data_parallel_world_size(p.group_name) > 1:
                dist.broadcast(p.data, src=groups._get_expert_broadcast_src_rank(p.group_name),
                               group=groups._get_expert_data_parallel_group(p.group_name))


def param_groups(params: Any) -> Any:
    """The optimizer's parameter groups with the expert parameters split out by expert group (``moe=True``)."""
    from ds_moe.utils import configure_moe_param_groups

    return configure_moe_param_groups(list(params))


def reducer(params: list[torch.nn.Parameter], wrapper: Any, options: ReduceOptions) -> GroupedReducer:
    """Bucketed all-reduce per group: the data-parallel one for shared parameters, each expert group's own. The
    (stage-0) wrapper learns the expert-parallel groups its gradient norm sums expert squares over."""
    from ds_moe import groups
    from ds_moe.utils import is_moe_param

    by_group: dict[str | None, list[torch.nn.Parameter]] = {}
    for p in params:
        by_group.setdefault(p.group_name if is_moe_param(p) else None, []).append(p)
    parts = []
    for name, members in by_group.items():
        group = options.group if name is None else groups._get_expert_data_parallel_group(name)
        # world_size stays the data-parallel size: expert gradients are averaged over every token of the batch
        opts = ReduceOptions(world_size=options.world_size, group=group,
                             communication_data_type=options.communication_data_type,
                             fp32_allreduce=options.fp32_allreduce, prescale_gradients=options.prescale_gradients,
                             gradient_predivide_factor=options.gradient_predivide_factor,
                             autocast_dtype_of=options.autocast_dtype_of, average=options.average)
        parts.append((members, BucketedAllReduce(members, wrapper, opts)))
        if name is not None:
            wrapper.expert_norm_groups[name] = groups._get_expert_parallel_group(name)
    return GroupedReducer(parts)
