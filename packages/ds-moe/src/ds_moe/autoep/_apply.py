"""``apply_autoep``: validate the ``expert_parallel`` section, detect the MoE blocks, create the expert groups,
replace the blocks (what DeepSpeed's engine does in ``_configure_expert_parallel``).

Collective when torch.distributed is initialised (it creates the ``ep_size_<n>`` groups): call it on every rank,
with the same model, before the engine is built. Idempotent: blocks already replaced are not matched again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_moe import groups
from ds_moe.autoep.config import parse_autoep_config, validate_autoep_config, validate_autoep_post_detection
from ds_moe.autoep.detect import AutoEP
from ds_moe.autoep.spec import AutoEPConfig
from ds_moe.ep_repack import gather_source_zero_params


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def as_autoep_config(config: Any) -> AutoEPConfig:
    """``AutoEPConfig`` from an ``AutoEPConfig``, a dict, or ds_config's ``ExpertParallelConfig`` (the keys the
    user set, so absent and null stay distinct)."""
    if isinstance(config, AutoEPConfig):
        return config
    if hasattr(config, "model_dump"):
        given = config.model_dump(exclude_unset=True, warnings=False)  # values set past validation reach ours
        given.setdefault("enabled", config.enabled)
        given.setdefault("autoep_size", config.autoep_size)
        config = given
    if not isinstance(config, dict):
        raise TypeError(f"apply_autoep: config must be the expert_parallel section (a dict, AutoEPConfig or "
                        f"ExpertParallelConfig), got {type(config).__name__}")
    return parse_autoep_config(config)


def _expert_parallel_rank(ep: int, data_first: bool = False) -> tuple[Any, int]:
    """This process's ``ep_size_<ep>`` group (created on first use; collective; ``data_first``: DeepSpeed's
    ``use_data_before_expert_parallelism`` rank order) and its rank in it."""
    if not _distributed():
        if ep > 1:
            raise RuntimeError(f"expert_parallel.autoep_size={ep} needs torch.distributed initialised "
                               "(init_process_group / deepspeed.init_distributed) before apply_autoep")
        return None, 0
    name = f"ep_size_{ep}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep, use_data_before_expert_parallel_=data_first)
    group = groups._get_expert_parallel_group(name)
    return group, dist.get_rank(group=group)


def apply_autoep(model: nn.Module, config: Any, world_size: int | None = None,
                 use_data_before_expert_parallel: bool = False) -> list[str]:
    """Replace ``model``'s MoE blocks by ``AutoEPMoELayer`` (in place); the replaced modules' names.

    ``config``: the ``expert_parallel`` section (nothing happens unless ``enabled``). ``world_size``: the ranks
    that train the model (default: torch.distributed's world, else 1). Expert weights are copied from the
    model, so outputs equal the unreplaced model's."""
    config = as_autoep_config(config)
    if not config.enabled:
        return []
    if world_size is None:
        world_size = dist.get_world_size() if _distributed() else 1
    tensor_parallel = groups.tensor_parallel_size(groups.mpu)
    if tensor_parallel > 1:
        raise ValueError(f"expert_parallel.enabled: AutoEP cannot be combined with tensor model parallelism from "
                         f"mpu (bwc_tensor_model_parallel_world_size={tensor_parallel})")
    validate_autoep_config(config, world_size=world_size, pp_size=1, tp_size=1, sp_size=1)
    auto_ep = AutoEP(model, config)
    specs = auto_ep.ep_parser()
    validate_autoep_post_detection(config, specs)
    group, rank = _expert_parallel_rank(config.autoep_size, use_data_before_expert_parallel)
    # a model built under zero.Init: each MoE block's partitioned weights are gathered (read only) while its
    # AutoEP layer copies them; the new layer's parameters are whole (the engine partitions them)
    sources = [p for spec in specs for p in model.get_submodule(spec.moe_module_name).parameters()]
    with gather_source_zero_params(sources):
        auto_ep.replace_moe_layers(specs, config.autoep_size, rank)
    for spec in specs:
        model.get_submodule(spec.moe_module_name).ep_group = group
    return [spec.moe_module_name for spec in specs]


def remap_parameters(params: Iterable[Any], model: nn.Module) -> list[Any]:
    """``params`` (parameters, or optimizer parameter-group dicts) taken from ``model`` before ``apply_autoep``,
    with the replaced expert parameters swapped for this rank's AutoEP ones (group dicts are copied)."""
    mapping: dict[int, list[nn.Parameter]] = {}
    for module in model.modules():
        mapping.update(getattr(module, "replaced_param_ids", {}))

    def swap(members: Iterable[Any]) -> list[Any]:
        out: list[Any] = []
        seen: set[int] = set()
        for param in members:
            for new in mapping.get(id(param), [param]):
                if id(new) not in seen:
                    seen.add(id(new))
                    out.append(new)
        return out

    items = list(params)
    if items and all(isinstance(item, dict) for item in items):
        return [{**item, "params": swap([item["params"]] if isinstance(item["params"], nn.Parameter)
                                        else item["params"])} for item in items]
    return swap(items)
