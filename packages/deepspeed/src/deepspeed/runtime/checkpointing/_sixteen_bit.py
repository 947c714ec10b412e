"""``save_16bit_model``: the model's weights alone, in the dtype they train in, as one file for inference/hubs.

Called "16-bit" because under fp16/bf16 training the module's parameters are already 16-bit; the file holds
``module.state_dict()`` as it is (no optimizer, no fp32 master copy). A ``.safetensors`` name writes the
safetensors format (needs the ``safetensors`` package); anything else ``torch.save``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.checkpointing._atomic import atomic_write, make_dirs
from deepspeed.runtime.checkpointing._engine_adapter import unwrap_module
from deepspeed.runtime.checkpointing._serialize import compact_for_save, module_state_dict, save_file


def _safetensors_bytes(state_dict: dict[str, Any]) -> bytes:
    try:
        from safetensors.torch import save as to_safetensors
    except ImportError as exc:
        raise ImportError("save_16bit_model: a '.safetensors' file name needs the 'safetensors' package "
                          "(pip install safetensors); use 'pytorch_model.bin' for torch.save format") from exc
    # safetensors stores contiguous tensors only and no aliasing: make each its own contiguous copy
    return to_safetensors({name: tensor.contiguous() for name, tensor in state_dict.items()})


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
    make_dirs(save_dir)
    path = os.path.join(os.fspath(save_dir), save_filename)
    if save_filename.endswith(".safetensors"):
        payload = _safetensors_bytes(weights)
        atomic_write(path, lambda handle: handle.write(payload))
    else:
        save_file(weights, path)
    return True
