"""The 3D (pipeline x tensor x data) layout of a checkpoint and its contraction onto a smaller one
(``model_3d_desc``, ``get_model_3d_descriptor``: DeepSpeed's names).

ZeRO shard files are numbered data-parallel-major: shard ``d * (pp * tp) + m`` is data-parallel rank ``d`` of
model-parallel position ``m``. A contraction first merges model-parallel positions (``reshape_meg_2d``), then
gives each new data-parallel rank a consecutive run of the old ranks' shards.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
)
from deepspeed.checkpoint.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from deepspeed.checkpoint.reshape_utils import get_files, get_files_with_prefix, get_zero_files, partition_data

PP_DIM = "PP"
TP_DIM = "TP"
DP_DIM = "DP"


class model_3d_desc:  # noqa: N801 - DeepSpeed's class name
    """A ``pp_degree x tp_degree x dp_degree`` layout."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def reshape(self, target_3d_desc: model_3d_desc, verbose: bool = False) -> list[meg_2d_parallel_map]:
        """Per data-parallel rank of ``target_3d_desc``, the 2D map of the source shard indices it reads."""
        valid, errors = self.can_reshape(target_3d_desc)
        if not valid:
            raise AssertionError(",".join(errors))
        two_d = reshape_meg_2d_parallel(old_pp_degree=self.pp_degree, old_tp_degree=self.tp_degree,
                                        new_pp_degree=target_3d_desc.pp_degree, new_tp_degree=target_3d_desc.tp_degree,
                                        verbose=verbose)
        flat = flatten_dp_dimension(two_d, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target_3d_desc.dp_degree)

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        """Whether the three indices lie inside this layout, and an error line per one that does not."""
        errors = [f"{name} indexing error: index {index} >= degree {degree}"
                  for index, degree, name in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                              (dp_index, self.dp_degree, DP_DIM)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: model_3d_desc) -> tuple[bool, list[str]]:
        """Whether ``target_3d_desc`` is a contraction of this layout (no degree grows), and why not."""
        errors = [f"Expansion reshape not supported - {name}: {old} ---> {new}"
                  for name, old, new in ((PP_DIM, self.pp_degree, target_3d_desc.pp_degree),
                                         (TP_DIM, self.tp_degree, target_3d_desc.tp_degree),
                                         (DP_DIM, self.dp_degree, target_3d_desc.dp_degree)) if new > old]
        return not errors, errors

    def __repr__(self) -> str:
        return f"model_3d_desc(pp_degree={self.pp_degree}, tp_degree={self.tp_degree}, dp_degree={self.dp_degree})"


def _recorded_degrees(model_file: str, dimensions: Any) -> tuple[int, int]:
    if not isinstance(dimensions, dict):
        raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}.")
    values = []
    for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
        value = dimensions.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RuntimeError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
        values.append(value)
    return values[0], values[1]


def get_model_3d_descriptor_from_metadata(file_list: Sequence[str], zero_file_list: Sequence[str],
                                          model_state_metadata: Sequence[tuple[str, dict[str, Any]]]) -> model_3d_desc:
    """The layout of a checkpoint folder from its file names and each model-states file's recorded
    ``checkpoint_parallel_dimensions`` (``[(model file, {key: value})]``); without any recorded dimensions
    (checkpoints of older writers) it is inferred from the file counts, as DeepSpeed does."""
    model_files = [model_file for model_file, _ in model_state_metadata]
    recorded, missing = [], []
    for model_file, metadata in model_state_metadata:
        dimensions = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dimensions is None:
            missing.append(model_file)
        else:
            recorded.append(_recorded_degrees(model_file, dimensions))
    if recorded:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(recorded)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {recorded}")
        pp_degree, tp_degree = recorded[0]
        if len(model_files) != pp_degree * tp_degree:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp_degree} * {CHECKPOINT_TP_DEGREE}={tp_degree}.")
        if len(zero_file_list) % (pp_degree * tp_degree):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp_degree} * {CHECKPOINT_TP_DEGREE}={tp_degree}.")
        return model_3d_desc(pp_degree, tp_degree, max(1, len(zero_file_list) // (pp_degree * tp_degree)))
    # legacy: the tensor slices of the first transformer layer (layer_01-model_XX files) give tp
    first_layer_slices = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    if first_layer_slices:
        tp_degree = first_layer_slices
        pp_degree = max(1, len(model_files) // tp_degree)
    else:
        tp_degree, pp_degree = max(1, len(model_files)), 1
    return model_3d_desc(pp_degree, tp_degree, max(1, len(zero_file_list) // (pp_degree * tp_degree)))


def get_model_3d_descriptor(dir: str | os.PathLike) -> model_3d_desc:  # noqa: A002 - DeepSpeed's argument name
    """The layout of the checkpoint tag folder ``dir`` (reads each ``mp_rank_*`` model-states file once)."""
    file_list = get_files(dir)
    metadata = []
    for model_file in get_files_with_prefix(file_list, MODEL_FILE_PREFIX):
        state = torch.load(model_file, map_location="cpu", weights_only=False)
        metadata.append((model_file, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
        del state
    return get_model_3d_descriptor_from_metadata(file_list, get_zero_files(dir), metadata)


def flatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, src_2d_size: int, dp_degree: int) -> meg_2d_parallel_map:
    """Each model-parallel source index ``m`` replaced by its shard index on every data-parallel rank
    (``m + d * src_2d_size``)."""
    flat = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for pp in range(meg_2d_map.pp_degree):
        for tp in range(meg_2d_map.tp_degree):
            for index in meg_2d_map.get_data(pp, tp):
                flat.add_data(pp, tp, [index + d * src_2d_size for d in range(dp_degree)])
    return flat


def unflatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, dp_degree: int) -> list[meg_2d_parallel_map]:
    """The flat shard lists split into ``dp_degree`` consecutive runs: one 2D map per new data-parallel rank."""
    maps = [meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree) for _ in range(dp_degree)]
    for pp in range(meg_2d_map.pp_degree):
        for tp in range(meg_2d_map.tp_degree):
            for part, two_d in zip(partition_data(meg_2d_map.get_data(pp, tp), dp_degree), maps, strict=True):
                two_d.add_data(pp, tp, list(part))
    return maps
