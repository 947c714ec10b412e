"""Helpers shared by the data analyzer and the data sampler: dtype fitting, work splits, builder open/close."""

from __future__ import annotations

from typing import Any

import numpy as np

from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder
from deepspeed.utils.logging import logger


def find_fit_int_dtype(min_value: int, max_value: int) -> type:
    """The smallest numpy integer type holding ``[min_value, max_value]`` (unsigned when ``min_value >= 0``)."""
    candidates = ((np.uint8, np.uint16, np.uint32, np.uint64) if min_value >= 0
                  else (np.int8, np.int16, np.int32, np.int64))
    for dtype in candidates:
        info = np.iinfo(dtype)
        if info.min <= min_value and max_value <= info.max:
            return dtype
    return candidates[-1]


def split_index(start_idx: int, end_idx: int, num_partitions: int) -> list[tuple[int, int]]:
    """``[start_idx, end_idx)`` cut into ``num_partitions`` contiguous ranges of near-equal length."""
    if num_partitions < 1:
        raise ValueError(f"split_index: num_partitions must be >= 1, got {num_partitions}")
    bounds = np.linspace(start_idx, end_idx, dtype=int, num=num_partitions + 1)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(num_partitions)]


def split_dataset(dataset: Any, num_workers: int, worker_id: int,
                  num_threads: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The sample ranges of every worker, and those of ``worker_id``'s threads inside its own range."""
    worker_splits = split_index(0, len(dataset), num_workers)
    thread_splits = split_index(worker_splits[worker_id][0], worker_splits[worker_id][1], num_threads)
    return worker_splits, thread_splits


def create_mmap_dataset_builder(fname: str, dtype: Any) -> MMapIndexedDatasetBuilder:
    """A builder writing ``<fname>.bin`` (finish with :func:`close_mmap_dataset_builder`)."""
    logger.debug(f"Creating mmap dataset builder at {fname}.")
    return MMapIndexedDatasetBuilder(f"{fname}.bin", dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    """End the builder's document and write ``<fname>.idx``."""
    builder.end_document()
    builder.finalize(f"{fname}.idx")
    logger.debug(f"Finalized mmap dataset builder at {fname}.")
