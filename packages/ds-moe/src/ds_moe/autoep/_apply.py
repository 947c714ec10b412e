"""``apply_autoep``: check the documented constraints, find the MoE blocks, create the expert groups, replace.

Collective when torch.distributed is initialised (it creates the ``ep_size_<n>`` groups): call it on every rank,
with the same model, before the engine is built. Idempotent: blocks already replaced are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_config import ConfigError, ConfigProblem, ExpertParallelConfig
from ds_moe import groups
from ds_moe.autoep._compat import KEY
from ds_moe.autoep._detect import MoELayerSpec, detect_moe_layers, resolve_preset
from ds_moe.autoep.layer import AutoEPMoELayer

SIZE_KEY = "expert_parallel.autoep_size"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_environment(config: ExpertParallelConfig, world_size: int) -> None:
    ep = config.autoep_size
    if config.load_balance_coeff is not None:
        raise ConfigError(ConfigProblem("expert_parallel.load_balance_coeff", "expert-bias (auxiliary-loss-free) "
                                        "load balancing is not supported by AutoEP yet; set it to null",
                                        config.load_balance_coeff))
    if world_size % ep:
        raise ConfigError(ConfigProblem(SIZE_KEY, f"must divide the world size {world_size} (each group of "
                                        f"autoep_size ranks shares one copy of the experts)", ep))
    tensor_parallel = groups._tensor_size(groups.mpu)
    if tensor_parallel > 1:
        raise ConfigError(ConfigProblem("expert_parallel.enabled", "AutoEP cannot be combined with tensor model "
                                        f"parallelism from mpu (tensor model parallel size {tensor_parallel}) yet",
                                        True))


def _check_layers(model: nn.Module, specs: list[MoELayerSpec], ep: int) -> None:
    for spec in specs:
        if spec.num_experts % ep:
            raise ConfigError(ConfigProblem(SIZE_KEY, f"must divide num_experts={spec.num_experts} of MoE layer "
                                            f"'{spec.name}' (each rank owns num_experts / autoep_size experts); "
                                            f"valid values: {_divisors(spec.num_experts)}", ep))
        if any(hasattr(p, "ds_id") for p in model.get_submodule(spec.name).parameters()):
            raise ConfigError(ConfigProblem("zero_optimization.stage", f"the parameters of '{spec.name}' are "
                                            "ZeRO-3 partitioned; AutoEP supports ZeRO stages 0, 1 and 2 only", 3))


def _expert_parallel_rank(ep: int) -> tuple[dist.ProcessGroup | None, int]:
    """This process's ``ep_size_<ep>`` group (created on first use; collective) and its rank in it."""
    if not _distributed():
        if ep > 1:
            raise RuntimeError(f"{SIZE_KEY}={ep} needs torch.distributed initialised (init_process_group / "
                               "deepspeed.init_distributed) before apply_autoep")
        return None, 0
    name = f"ep_size_{ep}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    group = groups._get_expert_parallel_group(name)
    return group, dist.get_rank(group=group)


def _swap(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)


def apply_autoep(model: nn.Module, config: ExpertParallelConfig, world_size: int | None = None) -> list[str]:
    """Replace ``model``'s MoE blocks by :class:`AutoEPMoELayer` (in place); the replaced modules' names.

    ``config``: the ``expert_parallel`` section (nothing happens unless ``enabled``). ``world_size``: the ranks
    that train the model (default: torch.distributed's world, else 1); ``autoep_size`` must divide it and every
    layer's expert count. Expert weights are copied from the model, so outputs equal the unreplaced model's.
    """
    if not config.enabled:
        return []
    if world_size is None:
        world_size = dist.get_world_size() if _distributed() else 1
    ep = config.autoep_size
    _check_environment(config, world_size)
    preset = resolve_preset(model, config)
    specs = detect_moe_layers(model, preset)
    if not specs:
        if any(getattr(m, "_is_autoep_layer", False) for m in model.modules()):
            return []  # converted before
        raise ConfigError(ConfigProblem(KEY, f"no MoE block matched preset '{preset.name}' (module names fully "
                                        f"matching {preset.moe_layer_pattern!r} with '{preset.router_pattern}' "
                                        f"and '{preset.experts_pattern}' children)", preset.name))
    _check_layers(model, specs, ep)
    group, rank = _expert_parallel_rank(ep)
    for spec in specs:
        layer = AutoEPMoELayer(spec, model.get_submodule(spec.name), ep, rank)
        layer.experts.ep_group = group
        _swap(model, spec.name, layer)
    return [spec.name for spec in specs]


def remap_parameters(params: Iterable[Any], model: nn.Module) -> list[Any]:
    """``params`` (parameters, or optimizer parameter-group dicts) taken from ``model`` before ``apply_autoep``,
    with every replaced expert parameter swapped for this rank's AutoEP one (group dicts are copied)."""
    mapping: dict[int, nn.Parameter] = {}
    for module in model.modules():
        mapping.update(getattr(module, "replaced_param_ids", {}))
    out = []
    for item in params:
        if isinstance(item, dict):
            members = item["params"]
            members = [members] if isinstance(members, nn.Parameter) else members
            item = {**item, "params": [mapping.get(id(p), p) for p in members]}
        else:
            item = mapping.get(id(item), item)
        out.append(item)
    return out
