"""The reduce side of ``DataAnalyzer``: merge every (worker, thread) map output into one metric index.

For a ``single_value_per_sample`` metric, under ``<save_path>/<metric>/`` (DeepSpeed's file names):

- ``<metric>_sample_to_metric``: item ``i`` = ``[metric value of sample i]`` (dataset order);
- ``<metric>_index_to_metric``: item ``k`` = ``[k-th smallest distinct value]``;
- ``<metric>_index_to_sample``: item ``k`` = ids of the samples with that value;
- ``<metric>_index_to_sample_percentile_merged``: the ``index_to_sample`` items concatenated in groups of
  ``max(1, distinct_values // 100)``, so that about 100 rows cover the percentiles (for ``difficulty_type:
  percentile``).

Values are stored in the smallest integer type holding their range, sample ids in the smallest holding
``len(dataset) - 1``. ``num_threads_reduce`` processes share the work; ``_thread<r>`` chunk files they write
are merged by the caller. ``accumulate_value_over_samples`` metrics are summed into ``<metric>_metric_value``.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence

import numpy as np

from deepspeed.runtime.data_pipeline.data_sampling._analyzer_map import SINGLE_VALUE, thread_dir
from deepspeed.runtime.data_pipeline.data_sampling._parallel import run_tasks
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from deepspeed.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_index,
)
from deepspeed.utils.logging import logger


def _map_outputs(num_workers: int, num_threads: int) -> list[tuple[int, int]]:
    return [(w, t) for w in range(num_workers) for t in range(num_threads)]


def _in_parallel(count: int, make_task: Callable[[int], Callable], what: str) -> list:
    return run_tasks([make_task(r) for r in range(count)], [f"{what} thread {r}" for r in range(count)])


def _gather_stats(metric_dir: str, name: str, pairs: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """Distinct values and sample count of some map outputs."""
    values: set[int] = set()
    count = 0
    for w, t in pairs:
        data = MMapIndexedDataset(os.path.join(metric_dir, f"worker{w}_thread{t}", f"{name}_sample_to_metric"))
        values.update(int(v) for v in np.unique(data.concatenated()))
        count += len(data)
    return sorted(values), count


def _merge_sample_to_metric(metric_dir: str, name: str, dtype: type, pairs: Sequence[tuple[int, int]],
                            chunk: str) -> None:
    builder = create_mmap_dataset_builder(chunk, dtype)
    for w, t in pairs:
        data = MMapIndexedDataset(os.path.join(metric_dir, f"worker{w}_thread{t}", f"{name}_sample_to_metric"))
        builder.add_scalars(data.concatenated().astype(np.int64))  # one value per sample
    close_mmap_dataset_builder(builder, chunk)


def _samples_with_value(metric_dir: str, name: str, value: int, pairs: Sequence[tuple[int, int]]) -> list[int]:
    samples: list[int] = []
    for w, t in pairs:
        path = os.path.join(metric_dir, f"worker{w}_thread{t}", f"{name}_metric_to_sample_{value}.csv")
        if os.path.isfile(path):
            with open(path, newline="") as handle:
                for row in csv.reader(handle):
                    samples.extend(int(x) for x in row)
    return samples


def _merge_metric_to_sample(metric_dir: str, name: str, sample_dtype: type, value_dtype: type,
                            values: Sequence[int], pairs: Sequence[tuple[int, int]], suffix: str) -> None:
    to_sample = os.path.join(metric_dir, f"{name}_index_to_sample{suffix}")
    to_metric = os.path.join(metric_dir, f"{name}_index_to_metric{suffix}")
    sample_builder = create_mmap_dataset_builder(to_sample, sample_dtype)
    metric_builder = create_mmap_dataset_builder(to_metric, value_dtype)
    for value in values:
        sample_builder.add_item_numpy(np.asarray(_samples_with_value(metric_dir, name, value, pairs), dtype=np.int64))
        metric_builder.add_item_numpy(np.asarray([value], dtype=np.int64))
    close_mmap_dataset_builder(sample_builder, to_sample)
    close_mmap_dataset_builder(metric_builder, to_metric)


def _concatenate(target: str, dtype: type, chunks: Sequence[str]) -> None:
    builder = create_mmap_dataset_builder(target, dtype)
    for chunk in chunks:
        builder.merge_file_(chunk)
    close_mmap_dataset_builder(builder, target)


def output_index_to_sample_percentile(index_to_sample_fname: str, index_to_metric_fname: str, metric_name: str,
                                      metric_save_path: str, total_num_samples: int,
                                      sample_idx_dtype: type) -> dict[int, int]:
    """Write ``<metric>_index_to_sample_percentile_merged``; returns ``{value: number of samples}``."""
    index_to_sample = MMapIndexedDataset(index_to_sample_fname)
    index_to_metric = MMapIndexedDataset(index_to_metric_fname)
    per_value = {int(index_to_metric[k][0]): len(index_to_sample[k]) for k in range(len(index_to_sample))}
    if sum(per_value.values()) != total_num_samples:
        raise RuntimeError(f"{index_to_sample_fname} indexes {sum(per_value.values())} samples, the dataset has "
                           f"{total_num_samples}")
    merged = os.path.join(metric_save_path, f"{metric_name}_index_to_sample_percentile_merged")
    builder = create_mmap_dataset_builder(merged, sample_idx_dtype)
    step = max(1, len(index_to_sample) // 100)
    for start in range(0, len(index_to_sample), step):
        builder.add_item_numpy(index_to_sample.concatenated(start, min(start + step, len(index_to_sample))))
    close_mmap_dataset_builder(builder, merged)
    return per_value


def log_value_percentiles(metric_name: str, num_sample_per_value: dict[int, int], total_num_samples: int) -> None:
    """Log the metric value at every 5th percentile (helps choosing min/max difficulty)."""
    seen, percentile, marks = 0, 5, []
    for value in sorted(num_sample_per_value):
        seen += num_sample_per_value[value]
        while percentile <= 100 and seen >= total_num_samples * percentile / 100.0:
            marks.append(f"{percentile}%: {value}")
            percentile += 5
    logger.info(f"Metric {metric_name} value percentiles: {', '.join(marks)}")


def reduce_single_value(save_path: str, name: str, total: int, num_workers: int, num_threads: int,
                        num_threads_reduce: int) -> dict[int, int]:
    """Build the four index files of one ``single_value_per_sample`` metric; returns samples per value."""
    metric_dir = os.path.join(save_path, name)
    pairs = _map_outputs(num_workers, num_threads)
    splits = split_index(0, len(pairs), num_threads_reduce)
    stats = _in_parallel(num_threads_reduce, lambda r: lambda: _gather_stats(
        metric_dir, name, pairs[splits[r][0]:splits[r][1]]), f"{name} gather")
    values = sorted(set().union(*(set(v) for v, _ in stats)))
    count = sum(c for _, c in stats)
    if count != total or not values:
        raise RuntimeError(f"DataAnalyzer reduce of {name!r}: the map outputs under {metric_dir} hold {count} "
                           f"samples, the dataset has {total}; did every map worker and thread finish?")
    value_dtype = find_fit_int_dtype(values[0], values[-1])
    sample_dtype = find_fit_int_dtype(0, total - 1)
    logger.info(f"Metric {name}: values in [{values[0]}, {values[-1]}] stored as {np.dtype(value_dtype).name}, "
                f"{total} sample ids as {np.dtype(sample_dtype).name}")
    chunk = os.path.join(metric_dir, f"{name}_sample_to_metric_thread")
    _in_parallel(num_threads_reduce, lambda r: lambda: _merge_sample_to_metric(
        metric_dir, name, value_dtype, pairs[splits[r][0]:splits[r][1]], f"{chunk}{r}"), f"{name} sample_to_metric")
    _concatenate(os.path.join(metric_dir, f"{name}_sample_to_metric"), value_dtype,
                 [f"{chunk}{r}" for r in range(num_threads_reduce)])
    value_splits = split_index(0, len(values), num_threads_reduce)
    _in_parallel(num_threads_reduce, lambda r: lambda: _merge_metric_to_sample(
        metric_dir, name, sample_dtype, value_dtype, values[value_splits[r][0]:value_splits[r][1]], pairs,
        f"_thread{r}"), f"{name} metric_to_sample")
    for kind, dtype in (("index_to_sample", sample_dtype), ("index_to_metric", value_dtype)):
        _concatenate(os.path.join(metric_dir, f"{name}_{kind}"), dtype,
                     [os.path.join(metric_dir, f"{name}_{kind}_thread{r}") for r in range(num_threads_reduce)])
    per_value = output_index_to_sample_percentile(
        os.path.join(metric_dir, f"{name}_index_to_sample"), os.path.join(metric_dir, f"{name}_index_to_metric"),
        name, metric_dir, total, sample_dtype)
    log_value_percentiles(name, per_value, total)
    return per_value


def reduce_accumulated(save_path: str, name: str, num_workers: int, num_threads: int) -> np.ndarray:
    """Sum the per-thread ``<metric>_metric_value`` files into ``<save_path>/<metric>/<metric>_metric_value``."""
    total = None
    for w, t in _map_outputs(num_workers, num_threads):
        part = MMapIndexedDataset(os.path.join(thread_dir(save_path, name, w, t), f"{name}_metric_value"))
        total = part[0].astype(np.int64) if total is None else total + part[0].astype(np.int64)
    dtype = find_fit_int_dtype(int(total.min()), int(total.max()))
    target = os.path.join(save_path, name, f"{name}_metric_value")
    builder = create_mmap_dataset_builder(target, dtype)
    builder.add_item_numpy(total)
    close_mmap_dataset_builder(builder, target)
    return total


def merge_map_results(dataset, metric_names: Sequence[str], metric_types: Sequence[str], save_path: str,
                      num_workers: int, num_threads: int, num_threads_reduce: int) -> None:
    """The default reduce: every metric's final files from all workers' and threads' map outputs."""
    for name, metric_type in zip(metric_names, metric_types, strict=True):
        if metric_type == SINGLE_VALUE:
            reduce_single_value(save_path, name, len(dataset), num_workers, num_threads, num_threads_reduce)
        else:
            reduce_accumulated(save_path, name, num_workers, num_threads)
