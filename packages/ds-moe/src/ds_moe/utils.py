"""Telling expert parameters apart, and the optimizer parameter groups DeepSpeed builds for MoE models.

An expert parameter is one marked ``allreduce = False`` (see :class:`ds_moe.experts.Experts`); its
``group_name`` names the expert group (``"ep_size_<n>"``) whose expert-data-parallel group averages it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_moe.layer import MoE

DEFAULT_MAX_GROUP_SIZE = 178956971


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` if ``m`` contains an MoE layer, else ``(False, 0)``."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter marked ``allreduce = False`` (an expert parameter)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list, list]:
    """``(shared_params, expert_params)``, order kept."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list, list]:
    """``(shared_grads, expert_grads)`` of the parameters that have a gradient, each cast to its param's dtype
    (used for gradient norms and overflow checks)."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _chunks(params: list[nn.Parameter], max_group_size: float) -> list[list[nn.Parameter]]:
    """Greedy runs of consecutive params whose element counts sum to at most ``max_group_size``
    (a single larger param forms its own run)."""
    runs: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > max_group_size:
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return runs + [current] if current else runs


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """Move expert params out of each (named) group into new groups, one per (group, expert group name).

    Each new group copies its source group's options, with ``name`` = the expert group name, ``moe=True``,
    and is split into runs of at most ``max_group_size`` elements (None: no split). The source groups keep
    their shared params; a list argument is updated in place and returned, as DeepSpeed does.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names: list[str] = []  # expert group names, first-seen order (the same on every rank)
    for group in param_groups:
        for p in group["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    if not names:
        return param_groups
    for i, group in enumerate(param_groups):
        if "name" not in group:
            raise ValueError(f"param group {i} has no 'name' key: MoE optimizer groups are built per named group "
                             "(e.g. {'params': [...], 'name': 'dense'})")
    new_groups: list[dict[str, Any]] = []
    for group in param_groups:
        params = list(group["params"])
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name in names:
            experts = [p for p in params if is_moe_param(p) and p.group_name == name]
            runs = _chunks(experts, max_group_size) if max_group_size is not None else [experts]
            new_groups.extend({**group, "name": name, "moe": True, "params": run} for run in runs)
    param_groups.extend(new_groups)
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Optimizer groups for ``model_parameters`` (params or param groups) with expert params split out."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be "
                            f"an iterable of Tensors or dicts, but got {type(p)}")
    if model_parameters and isinstance(model_parameters[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    if not any("moe" in group for group in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
