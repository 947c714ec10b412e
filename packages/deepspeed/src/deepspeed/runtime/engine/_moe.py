"""MoE in the engine (``ds_moe``): expert process groups, optimizer parameter groups, and the gradient reducer that
averages expert parameters over their expert-data-parallel group.

Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_<n>"`` (``ds_moe.experts.Experts``);
``set_deepspeed_parallelism()`` on every MoE layer creates the groups (the same calls on every rank, in module
order). Imported only for models that contain MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed.runtime.grad_reduce import BucketedAllReduce, GroupedReducer, ReduceOptions
from ds_config import ConfigError, ConfigProblem


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
    from ds_moe.utils import is_moe_param

    if not dist.is_initialized():
        return
    shared = [p for p in module.parameters() if not is_moe_param(p)]
    broadcast_shared(module, dp_group, params=shared)
    broadcast_experts([p for p in module.parameters() if is_moe_param(p)])


def broadcast_experts(params: list[torch.nn.Parameter]) -> None:
    """Each expert parameter's value from the first rank of its expert-data-parallel group (``group_name``)."""
    import torch.distributed as dist

    from ds_moe import groups

    if not dist.is_initialized():
        return
    with torch.no_grad():
        for p in params:
            if groups._get_expert_data_parallel_world_size(p.group_name) > 1:
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


def _native_and_autoep_layers(module: torch.nn.Module) -> tuple[list[str], list[str]]:
    import sys

    native_type = getattr(sys.modules.get("ds_moe.layer"), "MoE", None)
    native, autoep = [], []
    for name, sub in module.named_modules():
        if native_type is not None and isinstance(sub, native_type):
            native.append(name)
        elif getattr(sub, "_is_autoep_layer", False):
            autoep.append(name)
    return native, autoep


def check_zero3_moe(module: torch.nn.Module, autotp_size: int, sequence_parallel_size: int,
                    quantized_gradients: Callable[[], bool], mics_shard_size: int, hpz_partition_size: int,
                    expert_tensor_parallel_size: int) -> None:
    """ZeRO stage 3 trains AutoEP layers (experts partitioned over their expert-data-parallel group); native
    DeepSpeed MoE layers and the combinations that reduce or gather over other groups are refused, as DeepSpeed
    refuses them (``MoEWithZeroStage3``: a ``ConfigError`` and DeepSpeed's ``AssertionError``). ``quantized_gradients``
    is asked only once the layers are known to be AutoEP's."""
    native, autoep = _native_and_autoep_layers(module)

    def refuse(key: str, why: str, value: Any) -> None:
        raise MoEWithZeroStage3(ConfigProblem(key, why, value))

    if native:
        refuse("zero_optimization.stage", "Native DeepSpeed MoE is not supported with ZeRO Stage 3. Use AutoEP or "
               f"choose ZeRO stage 1/2 (native MoE layers: {native[:3]}); accepted: 0, 1, 2", 3)
    if not autoep:
        refuse("zero_optimization.stage", "MoE not supported with Stage 3: expert parameters outside AutoEP layers "
               "(ds_moe / deepspeed.moe) train with ZeRO stages 0-2; accepted: 0, 1, 2", 3)
    if autotp_size not in (0, 1):
        refuse("tensor_parallel.autotp_size", "AutoEP with ZeRO Stage 3 does not support AutoTP yet; accepted: 0 "
               "or 1", autotp_size)
    if sequence_parallel_size != 1:
        refuse("sequence_parallel_size", "AutoEP with ZeRO Stage 3 does not support sequence parallelism yet; "
               "accepted: 1", sequence_parallel_size)
    if quantized_gradients():
        refuse("zero_optimization.zero_quantized_gradients", "AutoEP with ZeRO Stage 3 does not support "
               "zero_quantized_gradients (qgZ, LoCo) yet; accepted: false", True)
    if mics_shard_size > 0:
        refuse("zero_optimization.mics_shard_size", "AutoEP with ZeRO Stage 3 does not support MiCS yet; "
               "accepted: -1 or 0", mics_shard_size)
    if hpz_partition_size > 1:
        refuse("zero_optimization.zero_hpz_partition_size", "AutoEP with ZeRO Stage 3 does not support hpZeRO "
               "secondary tensor groups yet; accepted: 1", hpz_partition_size)
    if expert_tensor_parallel_size != 1:
        refuse("expert_parallel.expert_tensor_parallel_size", "AutoEP with ZeRO Stage 3 only supports "
               "expert_parallel.expert_tensor_parallel_size=1", expert_tensor_parallel_size)


def zero3_placements(module: torch.nn.Module) -> list[Any]:
    """The partition groups ZeRO-3 places AutoEP expert parameters in: each ``ds_zero_partition_group_name``
    (``ep_size_<n>``) -> that expert group's expert-data-parallel group (``configure`` created them)."""
    import torch.distributed as dist

    from ds_moe import groups
    from ds_zero.zero3.expert_groups import PartitionGroup, placement_name

    names = sorted({n for p in module.parameters() if (n := placement_name(p)) is not None})
    if not (dist.is_available() and dist.is_initialized()):
        return [PartitionGroup(name, None) for name in names]
    return [PartitionGroup(name, groups._get_expert_data_parallel_group(name)) for name in names]
