"""The model on its way into the engine: its device, and the same weights on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_module(module: Any) -> torch.nn.Module:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"deepspeed.initialize: model must be a torch.nn.Module, got {type(module).__name__}")
    return module


def sparse_tensor_names(module: torch.nn.Module, sparse_gradients: bool) -> set[str]:
    """DeepSpeed's ``engine.sparse_tensor_module_names``: with ``sparse_gradients``, the ``<name>.weight`` of every
    ``nn.Embedding``/``nn.EmbeddingBag`` (whose gradients DeepSpeed exchanges sparse); saved in checkpoints."""
    if not sparse_gradients:
        return set()
    return {f"{name}.weight" for name, sub in module.named_modules()
            if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag))}


def broadcast_module(module: torch.nn.Module, dp_group: Any, params: list[torch.nn.Parameter] | None = None) -> None:
    """Give every data-parallel rank rank 0's parameters (``params``, default all) and buffers (ranks may have
    initialised differently)."""
    if not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return
    src = dist.get_global_rank(dp_group, 0) if dp_group is not None else 0
    params = list(module.parameters()) if params is None else params
    # deepspeed.linear's sharded LoRA base weights (ds_optim_param) hold a different slice on each rank by design
    params = [p for p in params if not hasattr(p, "ds_optim_param")]
    with torch.no_grad():
        for tensor in [*params, *module.buffers()]:
            dist.broadcast(tensor.data, src=src, group=dp_group)
