"""``DataAnalyzer``: offline map-reduce over a dataset that computes curriculum metrics and their index files.

Map: the dataset is split evenly over ``num_workers`` workers (e.g. nodes; this one is ``worker_id``) and each
worker's share over ``num_threads`` processes; each runs the ``metric_functions`` over its samples in batches
of ``batch_size`` and writes per-thread files. Reduce (worker 0, ``num_threads_reduce`` processes) merges them
into ``<save_path>/<metric>/<metric>_sample_to_metric``, ``_index_to_sample``, ``_index_to_metric`` and
``_index_to_sample_percentile_merged`` (see ``_analyzer_reduce``), the files the curriculum config's
``index_to_sample_path`` / ``index_to_metric_path`` point at.

A metric function takes a collated batch and returns one value per sample (``single_value_per_sample``, a
tensor/array of shape ``[batch]``) or a tensor to sum over the dataset (``accumulate_value_over_samples``), of
integer dtype ``metric_dtypes[i]``. ``DistributedDataAnalyzer`` does the same over ``torch.distributed`` ranks
without intermediate files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from deepspeed.runtime.data_pipeline.data_sampling import _analyzer_map as amap
from deepspeed.runtime.data_pipeline.data_sampling import _analyzer_reduce as areduce
from deepspeed.runtime.data_pipeline.data_sampling._distributed_analyzer import DistributedDataAnalyzer
from deepspeed.runtime.data_pipeline.data_sampling._parallel import run_tasks
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import _numpy_dtype
from deepspeed.runtime.data_pipeline.data_sampling.utils import split_dataset
from deepspeed.utils.logging import logger

__all__ = ["DataAnalyzer", "DistributedDataAnalyzer"]


class DataAnalyzer:
    """Compute per-sample metrics of ``dataset`` and write DeepSpeed's curriculum index files (see module doc).

    ``custom_map_init/update/finalize`` and ``custom_reduce`` replace the default steps with DeepSpeed's call
    signatures; ``sample_indices[i]`` is the id recorded for dataset position ``i`` (a batch dict with an
    ``index`` field gives the ids itself, as Megatron's datasets do); ``specific_threads`` runs only those map
    threads (e.g. to redo failed ones).
    """

    def __init__(self, dataset: Any, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[Any] = (), save_path: str = "./",
                 collate_fn: Callable | None = None, custom_map_init: Callable | None = None,
                 custom_map_update: Callable | None = None, custom_map_finalize: Callable | None = None,
                 custom_reduce: Callable | None = None, sample_indices: Sequence[int] | None = None) -> None:
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path = save_path
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices
        self._validate()

    def _validate(self) -> None:
        for name in ("num_workers", "num_threads", "num_threads_reduce", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DataAnalyzer: {name}={getattr(self, name)!r} must be a positive int")
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"DataAnalyzer: worker_id={self.worker_id} must be in [0, num_workers={self.num_workers})")
        bad = [t for t in self.specific_threads if not 0 <= t < self.num_threads]
        if bad:
            raise ValueError(f"DataAnalyzer: specific_threads {bad} are outside [0, num_threads={self.num_threads})")
        lengths = {len(self.metric_names), len(self.metric_functions), len(self.metric_types),
                   len(self.metric_dtypes)}
        if len(lengths) != 1:
            raise ValueError("DataAnalyzer: metric_names, metric_functions, metric_types and metric_dtypes must have "
                             f"the same length (got {len(self.metric_names)}, {len(self.metric_functions)}, "
                             f"{len(self.metric_types)}, {len(self.metric_dtypes)})")
        for name, metric_type, dtype in zip(self.metric_names, self.metric_types, self.metric_dtypes, strict=True):
            if metric_type not in amap.METRIC_TYPES:
                raise ValueError(f"DataAnalyzer: metric {name!r} has metric_type={metric_type!r}; accepted: "
                                 f"{', '.join(amap.METRIC_TYPES)}")
            _numpy_dtype(dtype)  # raises ValueError naming the accepted dtypes

    # ---- map ---------------------------------------------------------------------------------------------
    def run_map_helper(self, thread_id: int) -> None:
        """Run the metric functions over this worker's ``thread_id``-th share and write its files."""
        start_idx, end_idx = self.thread_splits[thread_id]
        logger.info(f"worker {self.worker_id} thread {thread_id}: analysing samples {start_idx} to {end_idx}")
        subset = Subset(self.dataset, list(range(start_idx, end_idx)))
        loader = DataLoader(subset, batch_sampler=BatchSampler(SequentialSampler(subset), self.batch_size, False),
                            num_workers=0, collate_fn=self.collate_fn, pin_memory=False)
        init = self.custom_map_init or amap.init_metric_results
        results = init(thread_id, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path,
                       self.worker_id)
        processed, started = 0, time.time()
        for batch_indices, data in zip(loader.batch_sampler, loader, strict=True):
            batch_start = start_idx + processed
            if self.custom_map_update is None:
                amap.update_metric_results(data, self.metric_types, self.metric_dtypes, self.metric_functions, results,
                                           batch_start, self.metric_names, self.sample_indices)
            else:
                self.custom_map_update(data, self.metric_types, self.metric_dtypes, self.metric_functions, results,
                                       batch_start)
            processed += len(batch_indices)
        finalize = self.custom_map_finalize or amap.finalize_metric_results
        finalize(self.metric_types, self.metric_dtypes, results)
        logger.info(f"worker {self.worker_id} thread {thread_id}: {processed} samples in "
                    f"{time.time() - started:.1f} s")

    def run_map(self) -> None:
        """The map step of this worker: its threads run in parallel processes."""
        self.worker_splits, self.thread_splits = split_dataset(self.dataset, self.num_workers, self.worker_id,
                                                               self.num_threads)
        threads = self.specific_threads or list(range(self.num_threads))
        run_tasks([lambda t=t: self.run_map_helper(t) for t in threads],
                  [f"worker {self.worker_id} map thread {t}" for t in threads])

    # ---- reduce ------------------------------------------------------------------------------------------
    def merge_map_results(self, dataset: Any, metric_names: Sequence[str], metric_types: Sequence[str],
                          save_path: str, num_workers: int, num_threads: int, num_threads_reduce: int) -> None:
        areduce.merge_map_results(dataset, metric_names, metric_types, save_path, num_workers, num_threads,
                                  num_threads_reduce)

    @staticmethod
    def output_index_to_sample_percentile(index_to_sample_fname: str, index_to_metric_fname: str, metric_name: str,
                                          metric_save_path: str, total_num_samples: int,
                                          sample_idx_dtype: Any) -> dict[int, int]:
        return areduce.output_index_to_sample_percentile(index_to_sample_fname, index_to_metric_fname, metric_name,
                                                         metric_save_path, total_num_samples, sample_idx_dtype)

    def run_reduce(self) -> None:
        """Merge every worker's map outputs (run once, after all workers finished their map)."""
        reduce = self.custom_reduce or self.merge_map_results
        reduce(self.dataset, self.metric_names, self.metric_types, self.save_path, self.num_workers,
               self.num_threads, self.num_threads_reduce)

    def run_map_reduce(self, comm_group: Any = None) -> None:
        """Map on this worker, then reduce on worker 0; workers meet in ``comm_group`` between the steps.

        Without an initialised ``torch.distributed`` there is nobody to meet: only ``num_workers=1`` works (run
        ``run_map`` on every worker and ``run_reduce`` once otherwise).
        """
        distributed = dist.is_available() and dist.is_initialized()
        if self.num_workers > 1 and not distributed:
            raise ValueError(f"DataAnalyzer.run_map_reduce: num_workers={self.num_workers} needs torch.distributed "
                             "initialised (one rank per worker); else call run_map() on each worker, then run_reduce()")
        self.run_map()
        if distributed:
            dist.barrier(group=comm_group)  # every worker's map files are complete
        if self.worker_id == 0:
            self.run_reduce()
        if distributed:
            dist.barrier(group=comm_group)  # the index files exist for everyone
