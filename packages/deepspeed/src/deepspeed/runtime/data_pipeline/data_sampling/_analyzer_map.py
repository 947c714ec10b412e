"""The map side of ``DataAnalyzer``: per (worker, thread) metric files.

Under ``<save_path>/<metric>/worker<w>_thread<t>/`` (DeepSpeed's layout):

- ``single_value_per_sample``: ``<metric>_sample_to_metric`` (an indexed dataset, one 1-element item per sample
  in dataset order) and ``<metric>_metric_to_sample_<value>.csv`` (rows of sample ids having that value,
  appended whenever more than 100 are pending, so memory stays bounded);
- ``accumulate_value_over_samples``: ``<metric>_metric_value`` (one item, the sum of the per-batch values).

``metric_results`` are dicts with DeepSpeed's keys, so custom map hooks written for DeepSpeed see the same.
"""

from __future__ import annotations

import csv
import glob
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import _numpy_dtype
from deepspeed.runtime.data_pipeline.data_sampling.utils import close_mmap_dataset_builder, create_mmap_dataset_builder

SINGLE_VALUE = "single_value_per_sample"
ACCUMULATE = "accumulate_value_over_samples"
METRIC_TYPES = (SINGLE_VALUE, ACCUMULATE)
_FLUSH_AT = 100  # sample ids kept per value before they are appended to its csv file


def thread_dir(save_path: str, metric_name: str, worker_id: int, thread_id: int) -> str:
    return os.path.join(save_path, metric_name, f"worker{worker_id}_thread{thread_id}")


def init_metric_results(thread_id: int, metric_names: Sequence[str], metric_types: Sequence[str],
                        metric_dtypes: Sequence[Any], save_path: str, worker_id: int) -> list[dict[str, Any]]:
    """Open one thread's output files; stale csv files of an earlier run are removed (they are appended to)."""
    results = []
    for name, metric_type, dtype in zip(metric_names, metric_types, metric_dtypes, strict=True):
        folder = thread_dir(save_path, name, worker_id, thread_id)
        os.makedirs(folder, exist_ok=True)
        if metric_type == SINGLE_VALUE:
            sample_to_metric = os.path.join(folder, f"{name}_sample_to_metric")
            metric_to_sample = os.path.join(folder, f"{name}_metric_to_sample")
            for stale in glob.glob(f"{glob.escape(metric_to_sample)}*"):
                os.remove(stale)
            results.append({"sample_to_metric_fname": sample_to_metric,
                            "sample_to_metric_builder": create_mmap_dataset_builder(sample_to_metric, dtype),
                            "metric_to_sample_fname": metric_to_sample,
                            "metric_to_sample_dict": defaultdict(list)})
        else:
            results.append({"metric_value": None, "metric_value_fname": os.path.join(folder, f"{name}_metric_value")})
    return results


def _append_rows(fname: str, pending: dict[Any, list[int]], at_least: int) -> None:
    """Append the pending sample ids of every value holding more than ``at_least`` to its csv file."""
    for value, samples in pending.items():
        if len(samples) > at_least:
            with open(f"{fname}_{value}.csv", "a", newline="") as handle:
                csv.writer(handle).writerow(samples)
            pending[value] = []


def _checked_values(metric_function: Callable, data: Any, name: str, dtype: Any) -> torch.Tensor:
    values = metric_function(data)
    if not (torch.is_tensor(values) or isinstance(values, np.ndarray)):
        raise TypeError(f"DataAnalyzer: metric_function of {name!r} must return a tensor or numpy array, got "
                        f"{type(values).__name__}")
    if _numpy_dtype(values.dtype) is not _numpy_dtype(dtype):
        raise TypeError(f"DataAnalyzer: metric_function of {name!r} returned dtype {values.dtype}, but its "
                        f"metric_dtype is {dtype}")
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values.detach().cpu()


def _sample_ids(data: Any, count: int, batch_start_idx: int, sample_indices: Sequence[int] | None) -> list[int]:
    """Each row's sample id: Megatron's ``data["index"]``, else the user's order, else the dataset position."""
    if isinstance(data, dict) and "index" in data:
        return [int(data["index"][row][0]) for row in range(count)]
    positions = range(batch_start_idx, batch_start_idx + count)
    if sample_indices is not None:
        return [int(sample_indices[p]) for p in positions]
    return list(positions)


def update_metric_results(data: Any, metric_types: Sequence[str], metric_dtypes: Sequence[Any],
                          metric_functions: Sequence[Callable], metric_results: list[dict[str, Any]],
                          batch_start_idx: int = 0, metric_names: Sequence[str] | None = None,
                          sample_indices: Sequence[int] | None = None) -> None:
    """Add one batch's metric values (``batch_start_idx``: dataset position of the batch's first sample)."""
    names = metric_names or [str(i) for i in range(len(metric_types))]
    for name, metric_type, dtype, function, result in zip(names, metric_types, metric_dtypes, metric_functions,
                                                          metric_results, strict=True):
        values = _checked_values(function, data, name, dtype)
        if metric_type == SINGLE_VALUE:
            rows = values.reshape(values.shape[0], -1) if values.dim() else values.reshape(1, 1)
            if rows.shape[1] != 1:
                raise ValueError(f"DataAnalyzer: metric {name!r} is single_value_per_sample but its function "
                                 f"returned {rows.shape[1]} values per sample (shape {tuple(values.shape)})")
            ids = _sample_ids(data, rows.shape[0], batch_start_idx, sample_indices)
            flat = rows.reshape(-1).numpy()
            result["sample_to_metric_builder"].add_scalars(flat)
            pending = result["metric_to_sample_dict"]
            for value, sample in zip(flat.tolist(), ids, strict=True):
                pending[value].append(sample)
            _append_rows(result["metric_to_sample_fname"], result["metric_to_sample_dict"], _FLUSH_AT)
        elif result["metric_value"] is None:
            result["metric_value"] = values.clone()
        else:
            result["metric_value"].add_(values)


def finalize_metric_results(metric_types: Sequence[str], metric_dtypes: Sequence[Any],
                            metric_results: list[dict[str, Any]]) -> None:
    """Write the index files and the remaining csv rows of one thread."""
    for metric_type, dtype, result in zip(metric_types, metric_dtypes, metric_results, strict=True):
        if metric_type == SINGLE_VALUE:
            close_mmap_dataset_builder(result["sample_to_metric_builder"], result["sample_to_metric_fname"])
            _append_rows(result["metric_to_sample_fname"], result["metric_to_sample_dict"], 0)
        elif result["metric_value"] is not None:
            builder = create_mmap_dataset_builder(result["metric_value_fname"], dtype)
            builder.add_item(result["metric_value"].reshape(-1))
            close_mmap_dataset_builder(builder, result["metric_value_fname"])
