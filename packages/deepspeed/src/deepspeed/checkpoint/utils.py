"""Checkpoint helpers (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

import os
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    ZERO_FILE_PREFIX,
)


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike, mp_rank_str: str) -> str:
    """``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt`` (``mp_rank_str``: already zero-padded, "00")."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str | os.PathLike, dp_rank: int, mp_rank: int) -> str:
    """``<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``: one data-parallel rank's shard."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder: str | os.PathLike, layer_id: str, tp_rank: int) -> str:
    """``<base_folder>/<layer_id>-model_<tp:02d>_model_states.pt`` (``layer_id``: "layer_01")."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of ``item`` whose tensors are detached clones on ``device``.

    Why: ``torch.save`` writes a tensor's whole storage, so a view into a flat ZeRO buffer (or any slice)
    drags the full buffer into the file. A clone owns a storage exactly its own size. Works on tensors and
    on lists, tuples (named tuples included) and dicts nesting them; dict subclasses keep their type and a
    ``state_dict``'s ``_metadata`` (used by ``load_state_dict``) is kept. Anything else is returned as is.
    """
    device = torch.device(device)
    if torch.is_tensor(item):
        # copy=True always allocates (even on the same device), sized to the elements, not the viewed
        # storage; dense views keep their strides, others come out contiguous
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        cloned = type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
        if hasattr(item, "_metadata"):
            cloned._metadata = item._metadata
        return cloned
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(clone_tensors_for_torch_save(v, device) for v in item))
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


def _pipeline_degree(mpu: Any) -> int:
    for name in ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"):  # Megatron, DeepSpeed
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def _tensor_degree(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                 "get_model_parallel_world_size"):  # new Megatron, DeepSpeed's pipeline grid, old Megatron
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def checkpoint_parallel_metadata(mpu: Any = None) -> dict[str, dict[str, int]]:
    """``{"checkpoint_parallel_dimensions": {"pp_degree": p, "tp_degree": t}}`` of a job with model-parallel unit
    ``mpu`` (None: 1 and 1), as DeepSpeed records it in each model-states file for ``DeepSpeedCheckpoint``."""
    pp, tp = (1, 1) if mpu is None else (_pipeline_degree(mpu), _tensor_degree(mpu))
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}
