"""``DeepSpeedDataSampler``: curriculum-learning batch sampler of the Data Efficiency Library.

Every global batch (``micro_batch_size * data_parallel_size * gradient_accumulation_steps`` samples) is drawn
by data-parallel rank 0 and broadcast, then cut into micro batches of ``micro_batch_size * data_parallel_size``
of which each rank takes its contiguous slice (``round(r * len / dp)`` .. ``round((r + 1) * len / dp)``): the
ranks get disjoint parts of the same global batch.

Before each global batch the curriculum step advances and every metric's ``CurriculumScheduler`` gives the max
accepted difficulty. When a difficulty changes, the samples newly admitted (``schedule_based`` clustering;
difficulty ``value`` or ``percentile``, see ``_difficulty_index``) form a new *cluster*: shuffled, written to
``<data_cluster_path>/cluster_<metric><difficulty>...`` (an indexed dataset) and read sequentially, reshuffled
into ``..._pass<k>`` when exhausted. A global batch draws from the clusters in proportion to their sizes (numpy
``default_rng(seed)``), so samples admitted earlier are not seen more often. ``single_cluster`` metrics admit
everything (the curriculum is applied afterwards, e.g. by truncating sequences to the current difficulty: see
``DeepSpeedDataLoader.post_process_func``).

``state_dict()`` holds the pending batch, consumed samples, curriculum step, difficulties, cluster files and
positions and the sampler's RNG state: loading it continues with exactly the batches the run would have drawn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deepspeed.runtime.data_pipeline import constants as C
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler, as_plain_dict
from deepspeed.runtime.data_pipeline.data_sampling import _difficulty_index as di
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from deepspeed.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
)
from deepspeed.utils.logging import logger

_WHERE = "data_efficiency.data_sampling.curriculum_learning"
_STATE_KEYS = ("batch", "consumed_samples", "curriculum_step", "current_difficulties", "data_cluster_paths",
               "data_cluster_current_position", "np_rng_state")


def _write_cluster(path: str, samples: np.ndarray, dtype: type) -> None:
    """Write ``samples`` as a one-item indexed dataset at ``path``; files appear atomically (temp name, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    builder = create_mmap_dataset_builder(tmp, dtype)
    builder.add_item_numpy(samples)
    close_mmap_dataset_builder(builder, tmp)
    os.replace(f"{tmp}.idx", f"{path}.idx")
    os.replace(f"{tmp}.bin", f"{path}.bin")


class DeepSpeedDataSampler:
    """Batch sampler (``DataLoader(batch_sampler=...)``) yielding this rank's sample ids per micro batch.

    ``data_efficiency_config``: the ``data_efficiency`` section (dict or typed); ``one_epoch_total_samples``:
    ``len(dataset)``; ``data_parallel_group``: the group to broadcast in (None: the default group);
    ``global_rank`` is kept for compatibility (data-parallel rank 0 draws the batches and writes the clusters).
    """

    def __init__(self, data_efficiency_config: Any, one_epoch_total_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_parallel_group: Any,
                 gradient_accumulation_steps: int, global_rank: int, drop_last: bool = True) -> None:
        config = as_plain_dict(data_efficiency_config)
        sampling = config.get(C.DATA_SAMPLING, {})
        curriculum = sampling.get(C.CURRICULUM_LEARNING, {})
        self.data_efficiency_config = config
        self.one_epoch_total_samples = int(one_epoch_total_samples)
        self.total_samples = self.one_epoch_total_samples * int(sampling.get("num_epochs", 1000))
        self.index_dtype = find_fit_int_dtype(0, self.one_epoch_total_samples)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self._check(curriculum)
        self.np_rng = np.random.default_rng(config.get("seed", 1234))
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.cluster_path = curriculum[C.CURRICULUM_LEARNING_CLUSTER_PATH]
        self.metrics: dict[str, dict[str, Any]] = dict(curriculum[C.CURRICULUM_LEARNING_METRICS])
        self.curriculum_schedulers = {
            name: CurriculumScheduler(metric, where=f"{_WHERE}.curriculum_metrics.{name}")
            for name, metric in self.metrics.items()}
        self.difficulty_type = {name: m[C.CURRICULUM_LEARNING_DIFFICULTY_TYPE] for name, m in self.metrics.items()}
        self.clustering_type = {name: m[C.CURRICULUM_LEARNING_CLUSTERING_TYPE] for name, m in self.metrics.items()}
        self.is_builder = data_parallel_rank == 0  # draws the batches and owns the cluster files
        self.data_clusters: list[MMapIndexedDataset] = []
        self.data_cluster_sizes: list[int] = []
        self.curriculum_index_to_sample: dict[str, MMapIndexedDataset] = {}
        self.curriculum_index_to_metric: dict[str, MMapIndexedDataset] = {}
        if self.is_builder:
            self._open_indexes()

    def _check(self, curriculum: Mapping[str, Any]) -> None:
        if not curriculum.get(C.CURRICULUM_LEARNING_ENABLED, False):
            raise ValueError(f"DeepSpeedDataSampler needs {_WHERE}.enabled=true (it samples by curriculum)")
        for key in (C.CURRICULUM_LEARNING_CLUSTER_PATH, C.CURRICULUM_LEARNING_METRICS):
            if not curriculum.get(key):
                raise ValueError(f"DeepSpeedDataSampler: {_WHERE}.{key} is required")
        checks = (("one_epoch_total_samples", self.total_samples), ("micro_batch_size", self.micro_batch_size),
                  ("data_parallel_size", self.data_parallel_size),
                  ("gradient_accumulation_steps", self.gradient_accumulation_steps))
        for name, value in checks:
            if value <= 0:
                raise ValueError(f"DeepSpeedDataSampler: {name} must be positive, got {value}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"DeepSpeedDataSampler: data_parallel_rank={self.data_parallel_rank} must be in "
                             f"[0, data_parallel_size={self.data_parallel_size})")

    def _open_indexes(self) -> None:
        os.makedirs(self.cluster_path, exist_ok=True)
        for name, metric in self.metrics.items():
            if self.clustering_type[name] == C.CURRICULUM_LEARNING_SINGLE_CLUSTER:
                continue
            self.curriculum_index_to_sample[name] = MMapIndexedDataset(metric[C.CURRICULUM_LEARNING_SAMPLE_PATH])
            if self.difficulty_type[name] == C.CURRICULUM_LEARNING_VALUE_BASED:
                self.curriculum_index_to_metric[name] = MMapIndexedDataset(metric[C.CURRICULUM_LEARNING_METRIC_PATH])

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
        """``{metric name: fn(curriculum_step) -> difficulty}`` for metrics with ``schedule_type: custom``."""
        unknown = sorted(set(schedule_func_dict) - set(self.curriculum_schedulers))
        if unknown:
            raise ValueError(f"set_custom_curriculum_learning_schedule: unknown metrics {unknown}; configured: "
                             f"{sorted(self.curriculum_schedulers)}")
        for name, function in schedule_func_dict.items():
            self.curriculum_schedulers[name].set_custom_get_difficulty(function)

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's slice ``[start, end)`` of a micro batch of ``batch_len`` samples (all ranks)."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        start = round(self.data_parallel_rank * batch_len / self.data_parallel_size)
        return start, round((self.data_parallel_rank + 1) * batch_len / self.data_parallel_size)

    # ---- clusters (data-parallel rank 0) -----------------------------------------------------------------
    def _admitted(self, name: str, low: float, high: float) -> np.ndarray:
        if self.difficulty_type[name] == C.CURRICULUM_LEARNING_VALUE_BASED:
            return di.samples_by_value(self.curriculum_index_to_sample[name], self.curriculum_index_to_metric[name],
                                       low, high, self.index_dtype)
        return di.samples_by_percentile(self.curriculum_index_to_sample[name], int(low), int(high),
                                        int(self.metrics[name][C.CURRICULUM_LEARNING_MAX_DIFFICULTY]),
                                        self.index_dtype)

    def _lowest(self, name: str) -> float:
        return float("-inf") if self.difficulty_type[name] == C.CURRICULUM_LEARNING_VALUE_BASED else 0

    def _new_cluster_samples(self, previous: Mapping[str, float]) -> np.ndarray | None:
        """The samples admitted since ``previous`` difficulties, or None when nothing changes."""
        everything = np.arange(self.one_epoch_total_samples, dtype=self.index_dtype)
        scheduled = [n for n in self.metrics if self.clustering_type[n] != C.CURRICULUM_LEARNING_SINGLE_CLUSTER]
        if len(scheduled) > 1:  # the samples every metric admits now, minus those already clustered
            admitted = everything
            for name in scheduled:
                within = self._admitted(name, self._lowest(name), self.current_difficulties[name])
                admitted = np.intersect1d(admitted, within, assume_unique=True)
            for cluster in self.data_clusters:
                admitted = np.setdiff1d(admitted, cluster[0], assume_unique=True)
            return admitted
        if scheduled:
            name = scheduled[0]
            return self._admitted(name, previous[name], self.current_difficulties[name])
        return everything if not self.data_clusters else None

    def _cluster_name(self) -> str:
        return C.CURRICULUM_LEARNING_CLUSTER_PREFIX + "".join(
            f"_{name}{self.current_difficulties[name]}" for name in self.curriculum_schedulers)

    def get_new_cluster(self, previous_difficulties: Mapping[str, float]) -> None:
        """Cluster the newly admitted samples (rank 0 writes the file); every rank records its name."""
        name = self._cluster_name()
        path = os.path.join(self.cluster_path, name)
        written = False
        if self.is_builder:
            samples = self._new_cluster_samples(previous_difficulties)
            written = samples is not None and len(samples) > 0
            if written:
                logger.info(f"new data cluster {name} ({len(samples)} samples, difficulties "
                            f"{previous_difficulties} -> {self.current_difficulties})")
                self.np_rng.shuffle(samples)
                _write_cluster(path, samples, self.index_dtype)
                self.data_clusters.append(MMapIndexedDataset(path))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
            else:
                logger.info(f"no sample is newly admitted at difficulties {self.current_difficulties}; no cluster")
        # rank 0 says whether it wrote the cluster (a stale file of that name from an earlier run must not count)
        if self._broadcast(torch.tensor([int(written)], dtype=torch.long)).item():
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    def sample_from_clusters(self) -> np.ndarray:
        """How many samples of the next global batch come from each cluster (proportional to cluster sizes)."""
        if not self.data_clusters:
            raise RuntimeError(f"curriculum data sampling: no sample is admitted at difficulties "
                               f"{self.current_difficulties}; raise min_difficulty or check the index files")
        weights = np.asarray(self.data_cluster_sizes, dtype=np.float64)
        picks = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True,
                                   p=weights / weights.sum())
        return np.bincount(picks, minlength=len(self.data_clusters))

    def reshuffle_clusters(self, cidx: int) -> None:
        """Start another pass over cluster ``cidx`` in a new random order.

        The new order goes to a new file ``<cluster>_pass<k>`` (DeepSpeed rewrites the cluster file in place):
        a checkpoint taken before the reshuffle still names the order it was reading, so resuming from it is
        exact even after later passes. Each pass costs one file of the cluster's size.
        """
        base, mark, count = self.data_cluster_paths[cidx].rpartition("_pass")
        base, passes = (base, int(count)) if mark and count.isdigit() else (self.data_cluster_paths[cidx], 0)
        name = f"{base}_pass{passes + 1}"
        samples = np.array(self.data_clusters[cidx][0])
        self.np_rng.shuffle(samples)
        _write_cluster(os.path.join(self.cluster_path, name), samples, self.index_dtype)
        self.data_cluster_paths[cidx] = name
        self.data_clusters[cidx] = MMapIndexedDataset(os.path.join(self.cluster_path, name))

    def get_sample_from_cluster(self, cidx: int, num_samples: int) -> list[int]:
        start = self.data_cluster_current_position[cidx]
        samples = [int(s) for s in self.data_clusters[cidx][0][start:start + num_samples]]
        self.data_cluster_current_position[cidx] += num_samples
        if len(samples) < num_samples:
            missing = num_samples - len(samples)
            logger.info(f"reshuffling cluster {cidx}")
            self.reshuffle_clusters(cidx)
            samples += [int(s) for s in self.data_clusters[cidx][0][:missing]]
            self.data_cluster_current_position[cidx] = missing
        return samples

    # ---- batches -----------------------------------------------------------------------------------------
    def _advance_curriculum(self) -> dict[str, float] | None:
        """Step every metric's schedule; the previous difficulties when any changed, else None."""
        self.curriculum_step += 1
        previous, changed = {}, False
        for name, scheduler in self.curriculum_schedulers.items():
            difficulty = int(scheduler.update_difficulty(self.curriculum_step))
            changed |= self.current_difficulties.get(name) != difficulty
            previous[name] = self.current_difficulties.get(name, self._lowest(name))
            self.current_difficulties[name] = difficulty
        return previous if changed else None

    def get_next_global_batch(self) -> None:
        """Draw the next global batch on rank 0 and share it with the other data-parallel ranks."""
        previous = self._advance_curriculum()
        if previous is not None:
            self.get_new_cluster(previous)
        batch = torch.full((self.global_batch_size,), -1, dtype=torch.long)
        if self.is_builder:
            drawn: list[int] = []
            for cidx, count in enumerate(self.sample_from_clusters()):
                drawn += self.get_sample_from_cluster(cidx, int(count))
            self.np_rng.shuffle(drawn)
            batch[:len(drawn)] = torch.tensor(drawn, dtype=torch.long)
        batch = self._broadcast(batch)
        self.batch = [int(i) for i in batch[batch != -1].tolist()]  # -1 pads a short batch to a fixed shape

    def __iter__(self):
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current = self.batch[:self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size:]
            if len(current) == self.micro_batch_times_data_parallel_size or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                self.consumed_samples += len(current)
                yield current[start:end]

    # ---- communication -----------------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return self.data_parallel_size > 1 and dist.is_available() and dist.is_initialized()

    def _broadcast(self, batch: torch.Tensor) -> torch.Tensor:
        if not self._distributed():
            return batch
        group = self.data_parallel_group
        source = dist.get_global_rank(group, 0) if group is not None else 0
        if dist.get_backend(group) == "nccl":  # NCCL moves device tensors only
            device = torch.device("cuda", torch.cuda.current_device())
            moved = batch.to(device)
            dist.broadcast(moved, source, group=group)
            return moved.cpu()
        dist.broadcast(batch, source, group=group)
        return batch

    # ---- checkpointing -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain Python values only, so checkpoints load with ``torch.load(weights_only=True)``."""
        return {
            C.CURRICULUM_LEARNING_BATCH: list(self.batch),
            C.CURRICULUM_LEARNING_CONSUMED_SAMPLES: int(self.consumed_samples),
            C.CURRICULUM_LEARNING_STEP: int(self.curriculum_step),
            C.CURRICULUM_LEARNING_CURRENT_DIFFICULTIES: {k: int(v) for k, v in self.current_difficulties.items()},
            C.CURRICULUM_LEARNING_DATA_CLUSTER_PATHS: list(self.data_cluster_paths),
            C.CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION: [int(p) for p in self.data_cluster_current_position],
            C.CURRICULUM_LEARNING_NP_RNG_STATE: self.np_rng.bit_generator.state,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict``; the cluster files are reopened from ``data_cluster_path``."""
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise KeyError(f"DeepSpeedDataSampler.load_state_dict: keys {missing} are missing")
        self.batch = list(state_dict[C.CURRICULUM_LEARNING_BATCH])
        self.consumed_samples = state_dict[C.CURRICULUM_LEARNING_CONSUMED_SAMPLES]
        self.curriculum_step = state_dict[C.CURRICULUM_LEARNING_STEP]
        self.current_difficulties = dict(state_dict[C.CURRICULUM_LEARNING_CURRENT_DIFFICULTIES])
        for name, difficulty in self.current_difficulties.items():
            if name in self.curriculum_schedulers:
                self.curriculum_schedulers[name].set_current_difficulty(difficulty)
        # older checkpoints stored absolute paths: keep the file name, found under the configured data_cluster_path
        self.data_cluster_paths = [os.path.basename(p) for p in state_dict[C.CURRICULUM_LEARNING_DATA_CLUSTER_PATHS]]
        self.data_cluster_current_position = list(state_dict[C.CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION])
        rng_state = state_dict[C.CURRICULUM_LEARNING_NP_RNG_STATE]
        if isinstance(rng_state, Mapping):
            self.np_rng.bit_generator.state = dict(rng_state)
        else:  # DeepSpeed's own checkpoints store numpy's global RNG state
            np.random.set_state(rng_state)
        self.data_clusters, self.data_cluster_sizes = [], []
        if self.is_builder:
            for name in self.data_cluster_paths:
                self.data_clusters.append(MMapIndexedDataset(os.path.join(self.cluster_path, name)))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
