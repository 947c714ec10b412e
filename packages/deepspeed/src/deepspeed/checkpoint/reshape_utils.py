"""File discovery and state merging for reading a DeepSpeed checkpoint folder at another parallel layout
(``DeepSpeedCheckpoint``, ``ZeROCheckpoint``): the names DeepSpeed's ``checkpoint.reshape_utils`` offers."""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    BF16_ZERO_FILE_PREFIX,
    FP16_ZERO_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    ZERO_FILE_PREFIX,
)


def basic_folder_validation(dir: str | os.PathLike) -> None:  # noqa: A002 - DeepSpeed's argument name
    """``dir`` must be an existing folder (AssertionError otherwise, as in DeepSpeed)."""
    if not os.path.exists(dir):
        raise AssertionError(f"{dir} path does not exist")
    if not os.path.isdir(dir):
        raise AssertionError(f"{dir} is not a folder")


def get_files(dir: str | os.PathLike) -> list[str]:  # noqa: A002
    """Every file under ``dir`` (recursively), as paths joined onto ``dir``."""
    return [os.path.join(root, name) for root, _, names in os.walk(dir) for name in names]


def get_files_with_prefix(all_files: Sequence[str], prefix: str) -> list[str]:
    """The paths in ``all_files`` whose file name starts with ``prefix``, sorted."""
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def validate_files(file_list: Sequence[str]) -> None:
    """Print the paths in ``file_list`` that are not files."""
    for path in file_list:
        if not os.path.isfile(path):
            print(f"Error: {path} is not existent")


def sort_zero_files(files: Sequence[str], prefix: str) -> list[str]:
    """ZeRO shard files ordered by (data-parallel rank, model-parallel rank), numerically."""
    pattern = re.compile(rf"{re.escape(prefix)}([0-9]+)_{re.escape(MODEL_FILE_PREFIX)}([0-9]+)")
    keyed = []
    for path in files:
        match = pattern.search(path)
        if match is None:
            raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
        keyed.append((int(match.group(1)), int(match.group(2)), path))
    return [path for _, _, path in sorted(keyed)]


def get_zero_files(dir: str | os.PathLike) -> list[str]:  # noqa: A002
    """The ZeRO optimizer shards under ``dir`` (``zero_pp_rank_*``, else ``fp16_``/``bf16_`` prefixed), ordered by
    rank; ``[]`` when there are none."""
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list: Sequence[Any], num_partitions: int) -> list[Sequence[Any]]:
    """``data_list`` cut into ``num_partitions`` equal consecutive runs (its length must divide evenly)."""
    if num_partitions < 1 or len(data_list) % num_partitions:
        raise AssertionError(f"partition_data: {len(data_list)} items do not split into {num_partitions} equal parts")
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


def merge_state(state_a: Any, state_b: Any, key_list: Sequence[str] = ()) -> Any:
    """Two ranks' states as one: tensors concatenated along dim 0, dicts by key (a key one side lacks is taken
    from the other), lists and tuples item by item; any other value is ``state_a``'s, 0-dim tensors included
    (an optimizer's ``step``, equal on every rank; DeepSpeed's own merge fails on them)."""
    where = ".".join(key_list) or "<root>"
    if type(state_a) is not type(state_b):
        raise ValueError(f"Cannot merge two states of types {type(state_a)} and type {type(state_b)} (at {where})")
    if isinstance(state_a, (dict, OrderedDict)):
        merged = type(state_a)()
        for key in [*state_a.keys(), *(k for k in state_b.keys() if k not in state_a)]:
            if key in state_a and key in state_b:
                merged[key] = merge_state(state_a[key], state_b[key], [*key_list, str(key)])
            else:
                merged[key] = state_a[key] if key in state_a else state_b[key]
        return merged
    if isinstance(state_a, (list, tuple)):
        if len(state_a) != len(state_b):
            raise ValueError(f"Cannot merge lists of different lengths, a = {len(state_a)} b = {len(state_b)} "
                             f"(at {where})")
        return type(state_a)(merge_state(a, b, key_list) for a, b in zip(state_a, state_b, strict=True))
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    return state_a
