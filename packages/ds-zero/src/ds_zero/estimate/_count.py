"""Parameter counting for the memory estimators: total parameters and the largest single layer.

Shared (tied) parameters count once. DeepSpeed de-duplicates by ``data_ptr()``, which also merges distinct
``Parameter`` objects viewing the same memory; we do the same for materialised tensors. Meta-device tensors
(models built from a config without allocating weights) all report ``data_ptr() == 0``, so for them
identity is the only meaningful key; ``Module.parameters()`` already yields each object once.

A model built under ``zero.Init`` (ZeRO-3) holds empty tensors (``numel() == 0``) in its parameters; their
whole size is ``ds_numel`` (the product of ``ds_shape``), and they too are keyed by identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamCounts:
    """``total_params``: distinct parameters of the model; ``largest_layer_params``: the most parameters
    owned directly (not through children) by a single module, which ZeRO-3 must gather at once."""

    total_params: int
    largest_layer_params: int


def _check_module(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def param_numel(param: torch.Tensor) -> int:
    """The whole size of ``param``: ``ds_numel`` (or the product of ``ds_shape``) for a ZeRO-3 partitioned
    parameter, else ``numel()``."""
    ds_numel = getattr(param, "ds_numel", None)
    if ds_numel is not None:
        return int(ds_numel)
    ds_shape = getattr(param, "ds_shape", None)
    return math.prod(ds_shape) if ds_shape is not None else param.numel()


def _storage_key(param: torch.Tensor) -> tuple:
    partitioned = hasattr(param, "ds_numel") or hasattr(param, "ds_shape")
    if partitioned or param.is_meta or param.numel() == 0 or param.data_ptr() == 0:
        return ("object", id(param))
    return (str(param.device), param.data_ptr())


def count_total_params(model: nn.Module) -> int:
    """Distinct parameters of ``model``, tied weights counted once (meta-device and ``zero.Init`` models
    included)."""
    sizes = {_storage_key(p): param_numel(p) for p in _check_module(model).parameters()}
    return sum(sizes.values())


def count_largest_layer_params(model: nn.Module) -> int:
    """The largest number of parameters registered directly on one module of ``model`` (0 if none)."""
    largest = 0
    for module in _check_module(model).modules():
        largest = max(largest, sum(param_numel(p) for p in module.parameters(recurse=False)))
    return largest


def count_params(model: nn.Module) -> ParamCounts:
    """Both counts the estimators need, in one call."""
    return ParamCounts(count_total_params(model), count_largest_layer_params(model))
