"""``state_dict`` / ``load_state_dict`` of a ZeRO-3 partitioned model.

``state_dict()`` follows each parameter's state, as in DeepSpeed: a gathered parameter (inside
``GatheredParameters``, a persistent one, one a module's forward holds) appears with its whole value, a released
one as the empty tensor its ``param.data`` then is. So the common recipe
``with GatheredParameters(model.parameters()): torch.save(model.state_dict(), f)`` saves the whole model.
The engine's own model-states files are written inside :func:`partitioned_entries`, where every partitioned
parameter is an empty tensor (the weights live in the optimizer files), so what those files hold never depends
on which parameters happen to be gathered or persistent.

``load_state_dict()`` accepts, per partitioned parameter, that empty tensor (the partition is left as it is: the
optimizer file restores it) or the whole value, whose slice goes into this rank's partition (and the fp32
master, once an engine trains it); any other size is an error that names the parameter.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ds_zero.zero3.param import ZeroParamStatus, is_partitioned, write_partition_from_full

_LOCAL = threading.local()  # per thread: another thread's state_dict() is not the engine's file


@contextlib.contextmanager
def partitioned_entries() -> Iterator[None]:
    """Within the block (this thread), ``state_dict()`` holds an empty tensor for every partitioned parameter,
    gathered or not: the content of DeepSpeed's stage-3 model-states files. Nestable."""
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth


def _entries(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # a released parameter's data is already empty; the rest is only for gathered ones in partitioned_entries()
    all_empty = getattr(_LOCAL, "depth", 0) > 0
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or not is_partitioned(param) or key not in state_dict:
            continue
        if all_empty or param.ds_status is not ZeroParamStatus.AVAILABLE:
            state_dict[key] = torch.empty(0, dtype=param.dtype, device=param.device)


def _load_partitions(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                     strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    from ds_zero.zero3.init import _refresh_masters

    changed = []
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or not is_partitioned(param) or key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue
        if value.numel() == param.ds_numel and value.numel() > 0:
            if tuple(value.shape) != tuple(param.ds_shape):
                raise ValueError(f"load_state_dict: {key} has shape {tuple(value.shape)} in the state dict and "
                                 f"{tuple(param.ds_shape)} in the ZeRO-3 model")
            write_partition_from_full(param, value)
            if param.ds_status is ZeroParamStatus.AVAILABLE:
                with torch.no_grad():
                    param.data.copy_(value.view_as(param.data))
            changed.append(param)
        elif value.numel() != 0:
            raise ValueError(f"load_state_dict: {key} has shape {tuple(value.shape)} in the state dict, but the ZeRO-3 "
                             f"model's parameter has shape {tuple(param.ds_shape)} (an empty tensor, as in a stage-3 "
                             "model-states file, keeps the partition)")
        state_dict[key] = param.data  # copying a tensor onto itself: the partition above is what counts
    if changed:
        _refresh_masters(changed)


def install_state_dict_hooks(model: torch.nn.Module) -> None:
    for module in model.modules():
        if any(p is not None and is_partitioned(p) for p in module._parameters.values()) \
                and not module.__dict__.get("_z3_state_dict_hooks"):
            module.register_state_dict_post_hook(_entries)
            module.register_load_state_dict_pre_hook(_load_partitions)
            module.__dict__["_z3_state_dict_hooks"] = True
