"""``ZeROCheckpoint``: the ZeRO optimizer shards of a checkpoint tag folder, read for a (possibly smaller)
pipeline x tensor x data layout: which shard files each new rank takes and their states merged into one
(DeepSpeed's ``deepspeed.checkpoint.ZeROCheckpoint``)."""

from __future__ import annotations

import os
from typing import Any

import torch

from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARTITION_COUNT
from deepspeed.checkpoint.reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from deepspeed.checkpoint.reshape_utils import basic_folder_validation, get_zero_files, merge_state

GROUP_STATE_KEY = "state"


class ZeROCheckpoint:
    """The ZeRO shards under ``dir``; ``source_3d`` (default: read from the folder) is the layout they were
    written at. ``reshape(target)`` re-maps them onto a contraction of that layout."""

    def __init__(self, dir: str | os.PathLike, source_3d: model_3d_desc | None = None) -> None:  # noqa: A002
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.num_files:
            raise AssertionError(f"No ZeRO files found in {dir}")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if dp_index >= len(self._3d_file_map):
            raise AssertionError(f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore: Any = (),
                           strip_tensor_paddings: bool = True) -> dict[str, Any] | None:
        """The shards of the new rank ``(pp, tp, dp)`` merged into one state (tensors concatenated in shard
        order), each shard's group padding cut off first when ``strip_tensor_paddings``; the merged state's
        ``partition_count`` is the target data-parallel degree."""
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = torch.load(path, map_location=torch.device("cpu"), weights_only=False)
            for key in keys_to_ignore:
                state.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
            self._update_partition_count(merged)
            if strip_tensor_paddings:
                self._clear_group_paddings(merged)
        return merged

    def print_3d_index_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, two_d in enumerate(self._3d_file_map):
            two_d.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, two_d in enumerate(self._3d_file_map):
            for pp_index in range(two_d.pp_degree):
                for tp_index in range(two_d.tp_degree):
                    files = [self.file_list[i] for i in two_d.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {files}")

    # ---- the optimizer-state fields a merge adjusts
    @staticmethod
    def _optimizer_field(state: dict[str, Any], key: str) -> Any:
        optimizer = state.get(OPTIMIZER_STATE_DICT)
        return None if optimizer is None else optimizer.get(key)

    def _strip_tensor_paddings(self, state: dict[str, Any]) -> None:
        base = self._optimizer_field(state, BASE_OPTIMIZER_STATE)
        groups = None if base is None else base.get(GROUP_STATE_KEY)
        paddings = self._optimizer_field(state, GROUP_PADDINGS)
        if groups is None or paddings is None:
            return
        for key, group_state in groups.items():
            if not paddings[key]:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = value.narrow(0, 0, value.numel() - paddings[key]).clone()

    def _clear_group_paddings(self, state: dict[str, Any]) -> None:
        paddings = self._optimizer_field(state, GROUP_PADDINGS)
        if paddings:
            state[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _update_partition_count(self, state: dict[str, Any]) -> None:
        counts = self._optimizer_field(state, PARTITION_COUNT)
        if counts:
            state[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
