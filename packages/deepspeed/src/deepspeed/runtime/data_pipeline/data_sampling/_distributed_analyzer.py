"""``DistributedDataAnalyzer``: the analysis with one ``torch.distributed`` rank per worker, results in memory.

Each rank computes the metrics of its share of the dataset (``num_threads`` forked processes within it), the
per-sample ``(value, sample id)`` pairs are gathered on rank 0 of the group, which writes the same files as
``DataAnalyzer`` (``sample_to_metric``, ``index_to_metric``, ``index_to_sample``, ``..._percentile_merged``;
``metric_value`` for accumulated metrics). No intermediate per-thread files. Rank 0 holds every pair of a metric
at once (16 bytes per sample); DeepSpeed spreads a sample sort over the ranks instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from deepspeed.runtime.data_pipeline.data_sampling._analyzer_map import METRIC_TYPES, SINGLE_VALUE
from deepspeed.runtime.data_pipeline.data_sampling._analyzer_map import _sample_ids as sample_ids
from deepspeed.runtime.data_pipeline.data_sampling._analyzer_reduce import (
    log_value_percentiles,
    output_index_to_sample_percentile,
)
from deepspeed.runtime.data_pipeline.data_sampling._parallel import run_tasks
from deepspeed.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_dataset,
)


def _write(prefix: str, dtype: type, items: Sequence[np.ndarray]) -> None:
    builder = create_mmap_dataset_builder(prefix, dtype)
    builder.add_items(items)
    close_mmap_dataset_builder(builder, prefix)


def write_single_value_index(metric_dir: str, name: str, values: np.ndarray, samples: np.ndarray,
                             total: int) -> None:
    """The four index files of a metric from its per-sample ``values`` (dataset order) and ``samples`` ids."""
    value_dtype = find_fit_int_dtype(int(values.min()), int(values.max()))
    sample_dtype = find_fit_int_dtype(0, total - 1)
    prefix = os.path.join(metric_dir, name)
    builder = create_mmap_dataset_builder(f"{prefix}_sample_to_metric", value_dtype)
    builder.add_scalars(values)
    close_mmap_dataset_builder(builder, f"{prefix}_sample_to_metric")
    order = np.lexsort((np.arange(len(values)), values))  # by value, then dataset position
    distinct, starts = np.unique(values[order], return_index=True)
    groups = np.split(samples[order], starts[1:])
    _write(f"{prefix}_index_to_metric", value_dtype, [np.array([v]) for v in distinct])
    _write(f"{prefix}_index_to_sample", sample_dtype, groups)
    per_value = output_index_to_sample_percentile(f"{prefix}_index_to_sample", f"{prefix}_index_to_metric", name,
                                                  metric_dir, total, sample_dtype)
    log_value_percentiles(name, per_value, total)


class DistributedDataAnalyzer:
    """Analyse ``dataset`` with every rank of ``comm_group`` (default: the world) as a worker; see module doc.

    Without ``comm_group``, ``num_workers``/``worker_id`` place this process (they must then match the default
    group). ``device``: where tensors travel for an NCCL group (gloo uses the CPU).
    """

    def __init__(self, dataset: Any, num_workers: int = 1, num_threads: int = 1, worker_id: int = 0,
                 batch_size: int = 1, metric_names: Sequence[str] = (), metric_functions: Sequence[Callable] = (),
                 metric_types: Sequence[str] = (), save_path: str = "./", collate_fn: Callable | None = None,
                 device: str = "cuda", comm_group: Any = None, sample_indices: Sequence[int] | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedDataAnalyzer needs torch.distributed initialised (deepspeed."
                               "init_distributed()); for one process use DataAnalyzer")
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.save_path = list(metric_types), save_path
        self.device, self.comm_group, self.sample_indices = device, comm_group, sample_indices
        self.num_threads = max(1, num_threads or 1)
        self.num_workers = dist.get_world_size(comm_group) if comm_group is not None else num_workers
        self.worker_id = dist.get_rank(comm_group) if comm_group is not None else worker_id
        bad = [t for t in self.metric_types if t not in METRIC_TYPES]
        if bad:
            raise ValueError(f"DistributedDataAnalyzer: metric_types {bad}; accepted: {', '.join(METRIC_TYPES)}")
        if dist.get_world_size(comm_group) != self.num_workers:
            raise ValueError(f"DistributedDataAnalyzer: num_workers={self.num_workers} must equal the group size "
                             f"{dist.get_world_size(comm_group)}")

    def run_map_helper(self, thread_id: int = 0) -> list[Any]:
        """One thread's metric results: ``(values, ids)`` arrays per single-value metric, a sum per accumulated."""
        start, end = self.thread_splits[thread_id]
        subset = Subset(self.dataset, list(range(start, end)))
        loader = DataLoader(subset, batch_sampler=BatchSampler(SequentialSampler(subset), self.batch_size, False),
                            num_workers=0, collate_fn=self.collate_fn)
        results: list[Any] = [([], []) if t == SINGLE_VALUE else None for t in self.metric_types]
        position = start
        for indices, data in zip(loader.batch_sampler, loader, strict=True):
            for m, (metric_type, function) in enumerate(zip(self.metric_types, self.metric_functions, strict=True)):
                values = torch.as_tensor(function(data)).detach().cpu()
                if metric_type == SINGLE_VALUE and values.numel() != len(indices):  # else values and ids misalign
                    raise ValueError(f"DistributedDataAnalyzer: metric {self.metric_names[m]!r} is "
                                     f"single_value_per_sample but its function returned {values.numel()} values "
                                     f"for a batch of {len(indices)} samples")
                if metric_type == SINGLE_VALUE:
                    results[m][0].append(values.reshape(-1).numpy().astype(np.int64))
                    results[m][1].append(np.asarray(sample_ids(data, len(indices), position, self.sample_indices)))
                else:
                    results[m] = values.clone() if results[m] is None else results[m] + values
            position += len(indices)
        if not len(subset):
            return [None] * len(results)
        return [(np.concatenate(r[0]), np.concatenate(r[1])) if t == SINGLE_VALUE else r
                for t, r in zip(self.metric_types, results, strict=True)]

    def _gather(self, array: np.ndarray) -> np.ndarray | None:
        """Every rank's int64 ``array`` concatenated in rank order, on group rank 0 (None elsewhere)."""
        on_nccl = dist.get_backend(self.comm_group) == "nccl"
        device = torch.device(self.device) if on_nccl else torch.device("cpu")
        local = torch.as_tensor(array, dtype=torch.int64, device=device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.num_workers)]
        dist.all_gather(sizes, torch.tensor([local.numel()], device=device), group=self.comm_group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.int64, device=device)
        padded[:local.numel()] = local
        root = dist.get_global_rank(self.comm_group, 0) if self.comm_group is not None else 0
        parts = [torch.zeros_like(padded) for _ in range(self.num_workers)] if self.worker_id == 0 else None
        dist.gather(padded, parts, dst=root, group=self.comm_group)
        if self.worker_id != 0:
            return None
        return np.concatenate([p[:int(s.item())].cpu().numpy() for p, s in zip(parts, sizes, strict=True)])

    def run_map_reduce(self) -> None:
        """Compute this rank's share, gather on rank 0, which writes the files; every rank returns after."""
        self.worker_splits, self.thread_splits = split_dataset(self.dataset, self.num_workers, self.worker_id,
                                                               self.num_threads)
        per_thread = run_tasks([lambda t=t: self.run_map_helper(t) for t in range(self.num_threads)],
                               [f"worker {self.worker_id} map thread {t}" for t in range(self.num_threads)])
        for m, (name, metric_type) in enumerate(zip(self.metric_names, self.metric_types, strict=True)):
            metric_dir = os.path.join(self.save_path, name)
            if metric_type == SINGLE_VALUE:
                pairs = [r[m] for r in per_thread if r[m] is not None]
                values = np.concatenate([v for v, _ in pairs]) if pairs else np.empty(0, dtype=np.int64)
                samples = np.concatenate([s for _, s in pairs]) if pairs else np.empty(0, dtype=np.int64)
                all_values, all_samples = self._gather(values), self._gather(samples)
                if self.worker_id == 0:
                    os.makedirs(metric_dir, exist_ok=True)
                    write_single_value_index(metric_dir, name, all_values, all_samples, len(self.dataset))
            else:  # ACCUMULATE
                parts = [r[m] for r in per_thread if r[m] is not None]
                total = torch.stack(parts).sum(0) if parts else torch.zeros(1, dtype=torch.int64)
                summed = self._gather(total.reshape(1, -1).numpy())
                if self.worker_id == 0:
                    os.makedirs(metric_dir, exist_ok=True)
                    summed = summed.reshape(self.num_workers, -1).sum(0)
                    dtype = find_fit_int_dtype(int(summed.min()), int(summed.max()))
                    _write(os.path.join(metric_dir, f"{name}_metric_value"), dtype, [summed])
            dist.barrier(group=self.comm_group)
