"""``DeepSpeedDataLoader`` (what ``deepspeed.initialize(training_data=...)`` returns) and ``RepeatingLoader``.

Each data-parallel rank reads its own shard through ``torch.utils.data.DistributedSampler``: shuffled with
seed 0 and reshuffled per epoch by ``set_epoch``; the dataset is padded (by repeating its first samples) to a
multiple of the data-parallel size so every rank runs the same number of steps. ``dataloader_drop_last``
is PyTorch's ``drop_last``: each rank drops its last micro batch when it is smaller than ``batch_size``.

With curriculum data sampling (``data_efficiency.data_sampling.curriculum_learning.enabled``, passed as
``deepspeed_dataloader_config`` by the engine, as DeepSpeed does) the sampler is a ``DeepSpeedDataSampler``
used as the loader's batch sampler; ``post_process_func(batch, sampler.state_dict())``, when set, receives each
batch with the sampler's state (its ``current_difficulties``: e.g. to truncate sequences to the difficulty).
The sampler is read lazily, so its checkpointed state matches the batches consumed; with ``num_workers > 0``
the loader prefetches, and a resume skips the prefetched batches (as in DeepSpeed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler


class RepeatingLoader:
    """Iterate ``loader`` forever: restart it when exhausted, advancing its sampler's epoch (new shuffle)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            sampler = getattr(self.loader, "data_sampler", None) or getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch") and hasattr(sampler, "epoch"):
                sampler.set_epoch(sampler.epoch + 1)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def _dp_placement(world_size: int | None, rank: int | None) -> tuple[int, int]:
    """Explicit data-parallel size/rank, else the default process group's, else a single rank."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"DeepSpeedDataLoader: data_parallel_rank={rank} must be in [0, data_parallel_world_size="
                         f"{world_size})")
    return world_size, rank


def _curriculum_sampler(dataset: Dataset, batch_size: int, loader_config: dict[str, Any], world_size: int | None,
                        rank: int | None, drop_last: bool) -> Sampler:
    """The ``DeepSpeedDataSampler`` of ``loader_config`` (DeepSpeed's keys: ``data_efficiency``,
    ``data_parallel_group``, ``gradient_accumulation_steps``, ``global_rank``)."""
    from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    world_size, rank = _dp_placement(world_size, rank)
    return DeepSpeedDataSampler(loader_config["data_efficiency"], len(dataset), batch_size, rank, world_size,
                                loader_config.get("data_parallel_group"),
                                loader_config.get("gradient_accumulation_steps", 1),
                                loader_config.get("global_rank", rank), drop_last=drop_last)


class DeepSpeedDataLoader:
    """Micro batches of this data-parallel rank's shard of ``dataset``.

    ``local_rank >= 0`` (a distributed run) shards with ``DistributedSampler``; ``local_rank < 0`` reads the
    whole dataset in random order with ``batch_size`` scaled by the local device count (one process driving
    every device). ``num_local_io_workers=None`` means 2 loader processes per device on an accelerator and
    none on CPU, where they would compete with the ranks for the same cores. ``tput_timer`` (optional) has
    its ``start()`` called before each batch is fetched.
    """

    def __init__(self, dataset: Dataset, batch_size: int, pin_memory: bool, local_rank: int, tput_timer: Any,
                 collate_fn: Callable | None = None, num_local_io_workers: int | None = None,
                 data_sampler: Sampler | None = None, data_parallel_world_size: int | None = None,
                 data_parallel_rank: int | None = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: dict[str, Any] | None = None) -> None:
        from deepspeed.accelerator import get_accelerator

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"DeepSpeedDataLoader: batch_size must be a positive int, got {batch_size!r}")
        accelerator = get_accelerator()
        device_count = 1
        loader_config = deepspeed_dataloader_config or {}
        self.curriculum_learning_enabled = bool(loader_config.get("curriculum_learning", False))
        self.post_process_func: Callable[[Any, dict], Any] | None = None
        if self.curriculum_learning_enabled:
            data_sampler = _curriculum_sampler(dataset, batch_size, loader_config, data_parallel_world_size,
                                               data_parallel_rank, dataloader_drop_last)
            num_local_io_workers = loader_config.get("num_workers", 0)
        elif data_sampler is None:
            if local_rank >= 0:
                replicas, rank = _dp_placement(data_parallel_world_size, data_parallel_rank)
                data_sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
            else:
                device_count = max(accelerator.device_count(), 1)
                data_sampler = RandomSampler(dataset)
        if num_local_io_workers is None:
            num_local_io_workers = 0 if accelerator.name == "cpu" else 2 * device_count
        self.dataset = dataset
        self.batch_size = batch_size * device_count
        self.device_count = device_count
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.tput_timer = tput_timer
        self.collate_fn = collate_fn
        self.num_local_io_workers = num_local_io_workers
        self.data_sampler = data_sampler
        self.dataloader_drop_last = bool(dataloader_drop_last)
        self.dataloader: DataLoader | None = None
        self.data: Iterator | None = None
        samples = len(data_sampler)
        self.len = samples // self.batch_size if self.dataloader_drop_last else math.ceil(samples / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of ``epoch`` (same on every rank, different per epoch); call before iterating."""
        if not hasattr(self.data_sampler, "set_epoch"):
            raise TypeError(f"set_epoch: the data sampler {type(self.data_sampler).__name__} has no set_epoch")
        self.data_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Micro batches per epoch on this rank."""
        return self.len

    def __iter__(self) -> DeepSpeedDataLoader:
        self._create_dataloader()
        return self

    def __next__(self) -> Any:
        if self.data is None:
            self._create_dataloader()
        if self.tput_timer is not None:
            self.tput_timer.start()
        batch = next(self.data)
        if self.curriculum_learning_enabled and self.post_process_func is not None:
            batch = self.post_process_func(batch, self.data_sampler.state_dict())
        return batch

    def _create_dataloader(self) -> DataLoader:
        if self.curriculum_learning_enabled:  # the sampler yields whole micro batches of sample ids
            self.dataloader = DataLoader(self.dataset, batch_sampler=self.data_sampler, collate_fn=self.collate_fn,
                                         num_workers=self.num_local_io_workers, pin_memory=self.pin_memory)
            self.data = iter(self.dataloader)
            return self.dataloader
        self.dataloader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=self.data_sampler,
            collate_fn=self.collate_fn,
            num_workers=self.num_local_io_workers,
            pin_memory=self.pin_memory,
            drop_last=self.dataloader_drop_last,
        )
        self.data = iter(self.dataloader)
        return self.dataloader
