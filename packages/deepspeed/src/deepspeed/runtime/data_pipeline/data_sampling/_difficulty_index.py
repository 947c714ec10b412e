"""Which samples a curriculum metric admits between two difficulties, read from the analyzer's index files.

- ``value``: the samples whose metric value ``v`` satisfies ``low < v <= high`` (``index_to_metric`` row ``k`` is
  the value of ``index_to_sample`` row ``k``);
- ``percentile``: the rows of ``index_to_sample`` (in ascending metric order) taken as one list of ``N`` samples,
  ``N // max_difficulty`` samples per percentile: positions ``[per * low, per * high)``, the last percentile
  running to the end (DeepSpeed's arithmetic; ``max_difficulty`` is normally 100).
"""

from __future__ import annotations

import numpy as np

from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype=dtype)


def samples_by_value(index_to_sample: MMapIndexedDataset, index_to_metric: MMapIndexedDataset, low: float,
                     high: float, dtype: type) -> np.ndarray:
    """Sample ids with ``low < metric value <= high``, in index order."""
    values = index_to_metric.concatenated()  # one value per row
    parts = [np.array(index_to_sample[row]) for row in np.flatnonzero((values > low) & (values <= high))]
    return _concat(parts, dtype)


def samples_by_percentile(index_to_sample: MMapIndexedDataset, low: int, high: int, max_percentile: int,
                          dtype: type) -> np.ndarray:
    """Sample ids between the ``low`` and ``high`` percentiles of the metric (row order = ascending metric)."""
    sizes = np.asarray(index_to_sample.sizes, dtype=np.int64)
    total = int(sizes.sum())
    per_percentile = total // max_percentile
    start, end = per_percentile * low, (total if high == max_percentile else per_percentile * high)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    parts = []
    for row in range(len(sizes)):
        row_start, row_end = bounds[row], bounds[row + 1]
        if row_end <= start or row_start == row_end:
            continue
        if row_start >= end:
            break
        parts.append(np.array(index_to_sample[row][max(0, start - row_start):min(row_end, end) - row_start]))
    return _concat(parts, dtype)
