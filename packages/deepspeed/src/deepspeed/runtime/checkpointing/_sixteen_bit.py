"""``save_16bit_model``: the model's weights alone, in the dtype they train in, as one file for inference/hubs.

Called "16-bit" because under fp16/bf16 training the module's parameters are already 16-bit; the file holds
``module.state_dict()`` as it is (no optimizer, no fp32 master copy). A ``.safetensors`` name writes the
safetensors format (needs the ``safetensors`` package); anything else ``torch.save``.

A ZeRO-3 parameter that is not gathered is an empty tensor in ``state_dict()``; weights holding one for a
parameter whose full shape is not empty are refused (the file would load as an empty model), naming them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.checkpointing._engine_adapter import unwrap_module
from deepspeed.runtime.checkpointing.atomic import atomic_write, make_dirs
from deepspeed.runtime.checkpointing.serialize import compact_for_save, module_state_dict, save_file


def _safetensors_bytes(state_dict: dict[str, Any]) -> bytes:
    try:
        from safetensors.torch import save as to_safetensors
    except ImportError as exc:
        raise ImportError("save_16bit_model: a '.safetensors' file name needs the 'safetensors' package "
                          "(pip install safetensors); use 'pytorch_model.bin' for torch.save format") from exc
    # safetensors stores contiguous tensors only and no aliasing: make each its own contiguous copy
    return to_safetensors({name: tensor.contiguous() for name, tensor in state_dict.items()})


def _emptied(module: torch.nn.Module, weights: dict[str, Any], given: dict[str, Any] | None) -> list[str]:
    """``"name (full shape)"`` of every parameter whose entry in ``weights`` is empty though its full shape
    (``ds_shape`` for a ZeRO-3 parameter) is not. ``given``: the caller's state dict, before compacting dropped
    the attributes of the parameters it may hold itself (``keep_vars=True``) under names the module lacks."""
    shapes = {name: tuple(getattr(p, "ds_shape", p.shape))
              for name, p in module.named_parameters(remove_duplicate=False)}
    found = []
    for name, value in (given if given is not None else weights).items():
        if name not in weights or not isinstance(value, torch.Tensor) or value.numel() != 0:
            continue
        full = shapes.get(name, tuple(getattr(value, "ds_shape", value.shape)))  # keep_vars: the parameter itself
        if math.prod(full) > 0:
            found.append(f"{name} {full}")
    return found


def _refuse_emptied(module: torch.nn.Module, weights: dict[str, Any], given: dict[str, Any] | None) -> None:
    emptied = _emptied(module, weights, given)
    if emptied:
        more = f" and {len(emptied) - 5} more" if len(emptied) > 5 else ""
        raise ValueError(
            f"save_16bit_model: the weights hold an empty tensor for {len(emptied)} parameter(s) whose full shape "
            f"is not empty: {', '.join(emptied[:5])}{more}. These are ZeRO-3 partitions that are not gathered; "
            "save through the engine (engine.save_16bit_model with zero_optimization."
            "stage3_gather_16bit_weights_on_model_save=true), or call this inside "
            "deepspeed.zero.GatheredParameters(model.parameters())")


def save_16bit_model(module: torch.nn.Module | Any, save_dir: str | os.PathLike,
                     save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False, *,
                     state_dict: dict[str, Any] | None = None, rank: int | None = None) -> bool:
    """Write ``module``'s weights to ``<save_dir>/<save_filename>`` atomically, on global rank 0 only.

    ``module``: the model, or an engine (its wrapped ``module`` is saved, keys without a ``module.`` prefix).

    ``state_dict``: weights to write instead of ``module.state_dict()`` (ZeRO-3 passes the gathered ones).
    ``rank``: this process's global rank (default: from ``torch.distributed``, 0 without it). Returns True,
    as DeepSpeed does. Not collective: other ranks return at once.
    """
    if not save_filename or os.path.basename(save_filename) != save_filename:
        raise ValueError(f"save_16bit_model: save_filename={save_filename!r} must be a plain file name, "
                         "e.g. 'pytorch_model.bin'")
    module = unwrap_module(module)
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return True
    if state_dict is None:
        weights = module_state_dict(module, exclude_frozen_parameters)
    else:
        weights = compact_for_save(state_dict)
        if exclude_frozen_parameters:
            for name, param in module.named_parameters():
                if not param.requires_grad:
                    weights.pop(name, None)
    _refuse_emptied(module, weights, state_dict)
    make_dirs(save_dir)
    path = os.path.join(os.fspath(save_dir), save_filename)
    if save_filename.endswith(".safetensors"):
        payload = _safetensors_bytes(weights)
        atomic_write(path, lambda handle: handle.write(payload))
    else:
        save_file(weights, path)
    return True
