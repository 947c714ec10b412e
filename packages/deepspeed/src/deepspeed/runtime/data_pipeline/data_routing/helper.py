"""Model surgery for random-LTD: wrap layers, attach the scheduler, strip the wrapper from state dicts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch.nn import Module

from deepspeed.runtime.data_pipeline import constants as C
from deepspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop


def _set_submodule(root: Module, name: str, module: Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def convert_to_random_ltd(model: Module, convert_type: type) -> Module:
    """Wrap every submodule of type ``convert_type`` in ``RandomLayerTokenDrop``; an engine (a model with
    ``random_ltd_initialize``) then attaches its scheduler to them. Returns ``model``."""
    c_model = model.module if hasattr(model, "module") else model
    targets = [name for name, module in c_model.named_modules()
               if name and isinstance(module, convert_type) and not isinstance(module, RandomLayerTokenDrop)]
    for name in targets:
        _set_submodule(c_model, name, RandomLayerTokenDrop(c_model.get_submodule(name)))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def random_ltd_initialize(module: Module, config: Any, scheduler: Any) -> int:
    """``init_config`` the ``RandomLayerTokenDrop`` layers of ``module`` whose name contains the configured layer
    ids (in sorted order, as DeepSpeed's engine matches them); returns how many were configured and raises
    ``ValueError`` when that is not ``random_ltd_layer_num``."""
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import as_plain_dict

    config = as_plain_dict(config)
    queue = sorted(config[C.RANDOM_LTD_LAYER_ID])
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and queue and str(queue[0]) in name:
            layer.init_config(config, scheduler, count)
            queue.pop(0)
            count += 1
    if config[C.RANDOM_LTD_LAYER_NUM] != count:
        raise ValueError(f"random_ltd_layer_num {config[C.RANDOM_LTD_LAYER_NUM]} must equal the number of "
                         f"RandomLayerTokenDrop layers matching random_ltd_layer_id ({count})")
    return count


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict:
    """``state_dict`` with the wrapper's ``.random_ltd_layer`` removed from every key (loads into the bare model)."""
    return OrderedDict((key.replace(".random_ltd_layer", ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: Module) -> OrderedDict:
    c_model = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(c_model.state_dict())
