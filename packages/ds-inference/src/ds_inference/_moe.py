"""Expert parallelism for inference: the ``moe`` section (``ep_size``, ``moe_experts``, ``type``) applied to a model
holding DeepSpeed MoE layers (``deepspeed.moe.layer.MoE``).

Each rank of an expert-parallel group holds ``num_experts / ep_size`` experts (the layer is built that way, as in
training). Here every MoE layer gets its expert-parallel process groups, made exactly as the training engine makes
them (the layer's own ``set_deepspeed_parallelism``; the same calls on every rank, in module order), and a
checkpoint of the whole model (global expert numbering) is mapped onto this rank's local experts.

MoE layers are recognised by their documented attributes (duck typing), so ds-inference needs no ds-moe import.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from ds_config.inference import DeepSpeedInferenceConfig, MoETypeEnum

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts"  # where a MoE layer keeps its local experts


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer on this rank: its module path, its rank within the expert-parallel group, its sizes."""

    prefix: str
    ep_rank: int
    num_local: int
    num_experts: int


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every DeepSpeed MoE layer of ``model`` (``ep_size``, ``num_experts``, ... and
    ``set_deepspeed_parallelism``), in module order."""
    found = []
    for name, module in model.named_modules():
        if (callable(getattr(module, "set_deepspeed_parallelism", None)) and hasattr(module, "deepspeed_moe")
                and all(isinstance(getattr(module, a, None), int) for a in ("ep_size", "num_experts",
                                                                            "num_local_experts"))):
            found.append((name, module))
    return found


def _check_layers(layers: list[tuple[str, nn.Module]], config: DeepSpeedInferenceConfig) -> None:
    """The ``moe`` settings that were given must describe the model's layers."""
    moe, given = config.moe, config.moe.model_fields_set
    for name, layer in layers:
        where = f"the model's MoE layer {name!r}"
        if "ep_size" in given and layer.ep_size != moe.ep_size:
            raise ValueError(f"moe.ep_size={moe.ep_size}, but {where} was built with ep_size={layer.ep_size}; "
                             "the experts are split when the layer is built (deepspeed.moe.layer.MoE(ep_size=...)): "
                             "build it with the same ep_size or set moe.ep_size to the layer's")
        if "moe_experts" in given and layer.num_experts not in moe.moe_experts:
            raise ValueError(f"moe.moe_experts={moe.moe_experts}, but {where} has num_experts={layer.num_experts}; "
                             "list every MoE layer's global expert count")
        residual = bool(getattr(layer, "use_residual", False))
        if "type" in given and (moe.type is MoETypeEnum.residual) != residual:
            raise ValueError(f"moe.type={moe.type.value!r}, but {where} is "
                             f"{'a residual' if residual else 'a standard'} MoE (use_residual={residual}); "
                             "accepted: 'standard' or 'residual', matching the layers")
        if layer.ep_size > 1 and not moe.enabled:
            raise ValueError(f"moe.enabled=False, but {where} is expert-parallel (ep_size={layer.ep_size}) and "
                             "cannot run without its expert groups; enable moe or build the layer with ep_size=1")


def _check_world(ep_sizes: set[int], tensor_parallel: bool) -> None:
    most = max(ep_sizes)
    if most == 1:
        return
    if tensor_parallel:
        raise ValueError(f"expert parallelism (ep_size={most}) together with tensor parallelism (tp_size > 1) is not "
                         "supported by this inference engine; use one of them")
    if not dist.is_initialized():
        raise ValueError(f"the model's MoE layers use ep_size={most}, which needs torch.distributed initialised with "
                         f"a multiple of {most} ranks (e.g. launch with the deepspeed launcher or torchrun)")
    world = dist.get_world_size()
    for size in sorted(ep_sizes):
        if world % size:
            raise ValueError(f"ep_size={size} does not divide the world size {world}; accepted: a divisor of it")


def setup_expert_parallel(model: nn.Module, config: DeepSpeedInferenceConfig,
                          tensor_parallel: bool) -> list[ExpertPlacement]:
    """Check the ``moe`` settings against ``model``, create the expert-parallel groups (collective on every rank)
    and say where each MoE layer's local experts sit in the global numbering."""
    layers = moe_layers(model)
    if not layers:
        if "moe" in config.model_fields_set and config.moe.enabled:
            warnings.warn(f"the inference config enables moe (ep_size={config.moe.ep_size}), but the model has no "
                          "DeepSpeed MoE layers (deepspeed.moe.layer.MoE): the moe settings have no effect",
                          UserWarning, stacklevel=4)
        return []
    _check_layers(layers, config)
    _check_world({layer.ep_size for _, layer in layers}, tensor_parallel)
    placements = []
    for name, layer in layers:
        ep_rank = 0
        if dist.is_initialized():
            layer.set_deepspeed_parallelism()
            group = getattr(layer.deepspeed_moe, "ep_group", None)
            ep_rank = dist.get_rank(group) if group is not None else 0
        placements.append(ExpertPlacement(name, ep_rank, layer.num_local_experts, layer.num_experts))
    return placements


def expert_checkpoint_keys(placements: list[ExpertPlacement],
                           model_keys: list[str]) -> tuple[dict[str, str], set[str]]:
    """``(aliases, known)``: the checkpoint key (global expert index) of each local expert tensor, and every
    expert key of the whole model (other ranks' experts are in a full checkpoint, but are no surprise)."""
    aliases: dict[str, str] = {}
    known: set[str] = set()
    for place in placements:
        head = f"{place.prefix}.{_EXPERTS}." if place.prefix else f"{_EXPERTS}."
        for key in model_keys:
            if not key.startswith(head):
                continue
            local, _, rest = key[len(head):].partition(".")
            if not local.isdigit():
                continue
            aliases[key] = f"{head}{place.ep_rank * place.num_local + int(local)}.{rest}"
            known.update(f"{head}{g}.{rest}" for g in range(place.num_experts))
    return aliases, known
