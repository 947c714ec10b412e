"""Tensor-parallel set-up of the inference engine: the process group and the AutoTP sharding call.

The group is, in order of precedence: ``tensor_parallel.mpu``'s model-parallel group, ``tensor_parallel.tp_group``,
or new groups of ``tp_size`` consecutive ranks (the tensor/model axis of a ``[data, model]`` grid, as
DeepSpeed builds them). The sharding itself belongs to ``ds_inference.autotp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_config.inference import DeepSpeedInferenceConfig, DeepSpeedTPConfig


def _new_groups(tp_size: int) -> Any:
    """Every rank builds every group (``new_group`` is collective) and keeps the one holding it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"tensor_parallel.tp_size={tp_size} needs torch.distributed to be initialised first "
                           "(deepspeed.init_distributed() or torch.distributed.init_process_group())")
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} must divide the world size {world}")
    mine = None
    for start in range(0, world, tp_size):
        ranks = list(range(start, start + tp_size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def tensor_parallel_group(tp: DeepSpeedTPConfig) -> Any | None:
    """The group the model is split across, or None when it is not split (``tp_size`` 1 or ``enabled`` off)."""
    if not tp.enabled:
        return None
    if tp.mpu is not None:
        group = tp.mpu.get_model_parallel_group()
    elif tp.tp_group is not None:
        group = tp.tp_group
    elif tp.tp_size > 1:
        return _new_groups(tp.tp_size)
    else:
        return None
    size = dist.get_world_size(group=group)
    if tp.tp_group is not None and tp.mpu is None and tp.tp_size not in (1, size):
        raise ValueError(f"tensor_parallel.tp_size={tp.tp_size} does not match the size {size} of "
                         "tensor_parallel.tp_group")
    return group if size > 1 else None


def _check_injection_policy(model: nn.Module, policy: dict[Any, Any]) -> None:
    """DeepSpeed's rule: each entry maps an nn.Module class (or class name) to the names of its all-reduce
    (row-parallel) Linear layers, which must exist in the model, or to a kernel-injection policy class
    (``{BertLayer: HFBertLayerPolicy}``), whose block AutoTP then shards by its heuristics."""
    names = [name for name, _ in model.named_modules()]
    for client, layers in policy.items():
        if not (isinstance(client, str) or (isinstance(client, type) and issubclass(client, nn.Module))):
            raise TypeError(f"injection_policy: key {client!r} must be a torch.nn.Module subclass (or its name)")
        if isinstance(layers, type):
            continue
        wanted = (layers,) if isinstance(layers, str) else tuple(layers) if isinstance(layers, (list, tuple)) else ()
        if not wanted or not all(isinstance(layer, str) for layer in wanted):
            raise TypeError(f"injection_policy: the value for {client!r} must name its all-reduce linears (a string "
                            f"or a tuple of strings) or be a policy class, got {layers!r}")
        for layer in wanted:
            if not any(name.endswith(layer) for name in names):
                raise ValueError(f"injection_policy: layer {layer!r} (for {client!r}) matches no module of the "
                                 "model; give the suffix of a module name, e.g. 'attn.out_proj'")


def shard_model(model: nn.Module, config: DeepSpeedInferenceConfig, group: Any) -> nn.Module:
    """Split ``model`` in place across ``group`` with AutoTP and make the ranks' RNGs agree (sampling)."""
    from ds_inference.autotp import autotp_shard  # imported here: plain tp_size=1 inference does not need it

    policy = config.injection_policy
    if policy:
        _check_injection_policy(model, policy)
    model = autotp_shard(model, group, injection_policy=policy,
                         tp_grain_size=config.tensor_parallel.tp_grain_size,
                         keep_module_on_host=config.keep_module_on_host)
    state = torch.get_rng_state()
    dist.broadcast(state, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(state)
    return model
