"""AutoEP folded onto AutoTP at run time: the groups, the gradient corrections and
``apply_autoep_folded`` (what ``deepspeed.initialize`` does when ``expert_parallel`` meets
``tensor_parallel.autotp_size > 1``). The layout and the gradient rules are in :mod:`ds_moe.autoep.folding`.

Collective: :func:`apply_autoep_folded` creates the ``ep_size_<n>`` groups with the folded rank lists (every rank,
same order). Gradient corrections run as tensor hooks, on each micro-batch's gradient before it is accumulated,
so every ZeRO stage (0, 1, 2) and the plain data-parallel reducer see corrected gradients: replicated parameters
are averaged over the TP group (one all-reduce per parameter and micro-batch, in the same backward order on every
TP peer), routed experts are divided by ``tp_size``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from ds_moe import groups
from ds_moe.autoep.config import validate_autoep_config, validate_autoep_post_detection
from ds_moe.autoep.detect import AutoEP
from ds_moe.autoep.folding import (
    AUTOEP_FOLDING_GRAD_CORRECTED_ATTR,
    AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE,
    AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL,
    AUTOEP_FOLDING_GRAD_REDUCE_SKIP,
    FoldingGroupHandles,
    ParallelFoldingSpec,
    assert_group_matches_spec,
    autoep_folding_gradient_reduction_strategy,
    build_folding_spec,
    expected_folding_group_tables,
    local_folding_ranks,
    mark_autoep_folding_router_parameter,
)
from ds_moe.autoep.spec import AutoEPConfig

FOLDING_HOOKED_ATTR = "ds_autoep_folding_grad_hooked"


def create_folding_group_handles(spec: ParallelFoldingSpec, *, tp_group: Any, dense_dp_group: Any) -> \
        FoldingGroupHandles:
    """This rank's groups of ``spec``: the given TP and dense data-parallel groups (AutoTP's) and the
    ``ep_size_<ep>`` expert groups, created with the folded rank lists (``RuntimeError`` when groups of that name
    already exist with another layout). Collective on first use."""
    groups.require_initialized()
    rank = dist.get_rank()
    name = f"ep_size_{spec.ep_size}"
    tables = expected_folding_group_tables(spec)
    if name in groups._get_expert_parallel_group_dict():
        assert_group_matches_spec(([groups._get_expert_parallel_group_ranks(name)],
                                   [groups._get_expert_data_parallel_group_ranks(name)]), spec)
    else:
        groups.register_expert_groups(name, [list(g) for g in tables.ep_groups],
                                      [list(g) for g in tables.edp_groups], edp_first=True)
    local = local_folding_ranks(rank, spec)
    for kind, group in (("tp", tp_group), ("dense_dp", dense_dp_group)):
        have = tuple(sorted(dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))))
        if have != tuple(sorted(local[kind])):
            raise RuntimeError(f"AutoEP+AutoTP folding: this rank's {kind} group holds ranks {have}, the folded "
                               f"layout {spec} expects {local[kind]}")
    return FoldingGroupHandles(spec=spec, tp_group=tp_group, dense_dp_group=dense_dp_group,
                               ep_group=groups._get_expert_parallel_group(name),
                               edp_group=groups._get_expert_data_parallel_group(name), ep_group_name=name,
                               tp_ranks=local["tp"], dense_dp_ranks=local["dense_dp"], ep_ranks=local["ep"],
                               edp_ranks=local["edp"])


def _correct(strategy: str, tp_group: Any, tp_size: int, grad: Tensor) -> Tensor:
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL:
        return grad / tp_size
    work = grad.detach().float().clone()  # fp32 sum: lanes' low-precision gradients would round per addition
    dist.all_reduce(work, group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE:
        work.div_(tp_size)
    return work.to(grad.dtype)


def install_folding_gradient_hooks(model: nn.Module, handles: FoldingGroupHandles) -> int:
    """Correct every trainable parameter's incoming gradients by its folding strategy (see the module
    docstring); marks them corrected, so DeepSpeed's explicit correction entry points leave them alone. The number
    of parameters hooked."""
    hooked = 0
    for name, param in model.named_parameters():
        if not param.requires_grad or getattr(param, FOLDING_HOOKED_ATTR, False):
            continue
        strategy = autoep_folding_gradient_reduction_strategy(handles.spec, param, param_name=name)
        if strategy == AUTOEP_FOLDING_GRAD_REDUCE_SKIP:
            continue
        param.register_hook(functools.partial(_correct, strategy, handles.tp_group, handles.spec.tp_size))
        setattr(param, FOLDING_HOOKED_ATTR, True)
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, True)
        hooked += 1
    return hooked


def apply_autoep_folded(model: nn.Module, config: AutoEPConfig, *, tp_group: Any, dense_dp_group: Any,
                        **features: Any) -> tuple[ParallelFoldingSpec, list[str]]:
    """Replace ``model``'s MoE blocks by AutoEP layers whose experts are spread over the folded expert groups, bind
    them to the folding handles and hook the gradient corrections. ``features``: ``validate_autoep_config``'s
    keyword arguments (``zero_stage``, offload flags, ``mpu``, ...). Returns the layout and the replaced names.
    Run again on the same model, it replaces nothing and hooks only the parameters made since (AutoTP's shards)."""
    world = dist.get_world_size()
    tp_size = dist.get_world_size(tp_group)
    validate_autoep_config(config, world_size=world, pp_size=1, tp_size=tp_size, sp_size=1, **features)
    spec = build_folding_spec(world_size=world, pp_size=1, tp_size=tp_size, ep_size=config.autoep_size,
                              etp_size=config.expert_tensor_parallel_size)
    auto_ep = AutoEP(model, config)
    specs = auto_ep.ep_parser()
    validate_autoep_post_detection(config, specs)
    handles = create_folding_group_handles(spec, tp_group=tp_group, dense_dp_group=dense_dp_group)
    auto_ep.replace_moe_layers(specs, spec.ep_size, dist.get_rank(group=handles.ep_group))
    for layer_spec in specs:
        layer = model.get_submodule(layer_spec.moe_module_name)
        layer.set_deepspeed_parallelism(folding_group_handles=handles)
        for param in layer.router.parameters():
            mark_autoep_folding_router_parameter(param)
    install_folding_gradient_hooks(model, handles)
    return spec, [s.moe_module_name for s in specs]
