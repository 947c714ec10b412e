"""Checks of what a checkpoint file holds against the live model, run before anything is loaded (see ``_restore``).

Each failure is a :class:`CorruptCheckpointError` with ``checkpoint_path`` and ``reason``, so the load's
agreement reports it as ``<file>: <reason>`` on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.checkpointing.errors import CorruptCheckpointError


def content_error(path: str, reason: str) -> CorruptCheckpointError:
    """A readable file whose content does not fit (a missing key, a wrong shape)."""
    return CorruptCheckpointError(f"{path}: {reason}", path=path, reason=reason)


def check_module_weights(module: torch.nn.Module, weights: Any, strict: bool, path: str,
                         what: str = "the model") -> None:
    """Raise :class:`CorruptCheckpointError` (what ``load_state_dict`` would raise later) when ``weights`` cannot load
    into ``module``: missing keys under ``strict``, or a tensor whose shape is not the live one. A ZeRO-3
    partitioned parameter accepts an empty tensor (its partition is in the optimizer files) or its full shape."""
    if not isinstance(weights, dict):
        raise content_error(path, f"holds a {type(weights).__name__} where the state dict of {what} belongs")
    live = module.state_dict()
    full_shapes = {name: tuple(p.ds_shape) for name, p in module.named_parameters(remove_duplicate=False)
                   if hasattr(p, "ds_shape")}
    problems = []
    if strict:
        missing = [key for key in live if key not in weights]
        if missing:
            problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for key, value in weights.items():
        here = live.get(key)
        if not (torch.is_tensor(value) and torch.is_tensor(here)) or value.shape == here.shape:
            continue
        if key in full_shapes and (value.numel() == 0 or tuple(value.shape) == full_shapes[key]):
            continue
        problems.append(f"{key} has shape {tuple(value.shape)} in the file and "
                        f"{full_shapes.get(key, tuple(here.shape))} in the model")
    if problems:
        raise content_error(path, f"the saved weights do not fit {what}: " + "; ".join(problems[:8]))
