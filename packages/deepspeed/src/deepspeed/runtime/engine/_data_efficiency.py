"""Data efficiency in the engine: the legacy ``curriculum_learning`` schedule (``curriculum_seqlen`` passed to the
model's forward, as DeepSpeed's engine does) and the random-LTD token schedule (``data_efficiency.data_routing``).

Both are updated in ``forward`` from the engine's step counter, as DeepSpeed does (the curriculum with
``global_steps + 1``, random-LTD with ``global_steps``), so a resumed run recomputes them from the restored counter.
Random-LTD's consumed layer-tokens are saved in checkpoints (``random_ltd``), as DeepSpeed does.

Curriculum data sampling (``data_efficiency.data_sampling.curriculum_learning``) lives in the training data
loader: :func:`dataloader_config` is what ``deepspeed_io`` hands ``DeepSpeedDataLoader`` so that it samples with
``DeepSpeedDataSampler``; the sampler's state is saved in checkpoints (``data_sampler``).

Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``) also lives in the training loader:
:func:`dynamic_batching_io` gives ``deepspeed_io`` the token-budget micro batches and replaces the engine's LR
schedule by a ``VariableBatchSizeLR`` wrapping it (saved in checkpoints as the ``lr_scheduler``).

:class:`DataMethods` is the engine's side of all this (a mixin of ``DeepSpeedEngine``): ``deepspeed_io`` and the
curriculum / random-LTD accessors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class DataEfficiency:
    """The schedules one engine runs (``None`` each when its section is off)."""

    def __init__(self, config: Any, global_batch: int, micro_batch: int) -> None:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
        from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

        cl = config.curriculum_learning
        self.curriculum = CurriculumScheduler(cl) if cl.enabled else None
        self.seqlen = self.curriculum is not None and cl.curriculum_type == "seqlen"
        ltd = config.data_efficiency.data_routing.random_ltd
        self.random_ltd_config = None
        self.random_ltd = None
        if ltd.enabled:
            self.random_ltd_config = ltd.model_dump(exclude_none=True) | {"global_batch_size": global_batch,
                                                                          "micro_batch_size": micro_batch}
            self.random_ltd = RandomLTDScheduler(self.random_ltd_config)

    def before_forward(self, global_steps: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Advance the schedules for this training forward; the kwargs with ``curriculum_seqlen`` added."""
        if self.curriculum is not None:
            self.curriculum.update_difficulty(global_steps + 1)
            if self.seqlen:
                kwargs = {**kwargs, "curriculum_seqlen": self.curriculum.get_current_difficulty()}
        if self.random_ltd is not None:
            self.random_ltd.update_seq(global_steps)
        return kwargs


def build(config: Any, global_batch: int, micro_batch: int) -> DataEfficiency | None:
    """The engine's data-efficiency schedules, or None when neither section is enabled (the common case)."""
    if not (config.curriculum_learning.enabled or config.data_efficiency.data_routing.random_ltd.enabled):
        return None
    return DataEfficiency(config, global_batch, micro_batch)


def curriculum_sampling_enabled(config: Any) -> bool:
    """Whether the training loader samples by curriculum (DeepSpeed checks this key alone)."""
    return bool(config.data_efficiency.data_sampling.curriculum_learning.enabled)


def dataloader_config(engine: Any, route: str) -> dict[str, Any] | None:
    """DeepSpeed's ``deepspeed_dataloader_config`` for the training route with curriculum sampling, else None."""
    config = engine._config
    if route != "train" or not curriculum_sampling_enabled(config):
        return None
    return {
        "curriculum_learning": True,
        "data_efficiency": config.data_efficiency,
        "data_parallel_group": engine.dp_group,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "global_rank": engine.global_rank,
        "num_workers": config.data_efficiency.data_sampling.num_workers,
    }


def dynamic_batching_enabled(config: Any) -> bool:
    """Whether the training loader batches by token budget (DeepSpeed checks this key alone)."""
    return bool(config.data_efficiency.data_sampling.dynamic_batching.enabled)


def dynamic_batching_io(engine: Any, dataset: Any, route: str, data_sampler: Any,
                        collate_fn: Any) -> dict[str, Any] | None:
    """``DeepSpeedDataLoader`` arguments (dataset, batch_size, data_sampler, collate_fn, pin_memory,
    num_local_io_workers) for a training loader with dynamic batching, else None; sets ``engine.lr_scheduler``
    to the LR-scaling schedule. A caller's own ``data_sampler`` (e.g. DeepSpeed's ``deepspeed_io_kwargs`` from
    ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``) is used as given."""
    if route != "train" or data_sampler is not None or not dynamic_batching_enabled(engine._config):
        return None
    if curriculum_sampling_enabled(engine._config):
        raise ValueError("data_efficiency.data_sampling: dynamic_batching and curriculum_learning cannot both be "
                         "enabled for one training loader; accepted: one of them")
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    )

    _, scheduler, kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataloader_collate_fn=collate_fn)
    if scheduler is not None:
        engine.lr_scheduler = scheduler
    return kwargs


def set_custom_schedule(engine: Any, schedule: Any) -> None:
    """``engine.set_custom_curriculum_learning_schedule``: a ``{metric: fn}`` dict goes to the curriculum data
    sampler (DeepSpeed's form), a single function to the legacy ``curriculum_learning`` schedule."""
    loader = getattr(engine, "training_dataloader", None)
    if isinstance(schedule, dict):
        if loader is None or not getattr(loader, "curriculum_learning_enabled", False):
            raise RuntimeError("set_custom_curriculum_learning_schedule({metric: fn}): needs data_efficiency."
                               "data_sampling.curriculum_learning enabled and training_data given to initialize()")
        loader.data_sampler.set_custom_curriculum_learning_schedule(schedule)
        return
    if not callable(schedule):
        raise TypeError("set_custom_curriculum_learning_schedule: expected {metric name: fn(step) -> difficulty} "
                        f"or (legacy curriculum_learning) fn(step) -> difficulty, got {type(schedule).__name__}")
    if engine.data_efficiency is None or engine.data_efficiency.curriculum is None:
        raise RuntimeError("set_custom_curriculum_learning_schedule(fn): the legacy curriculum_learning section is "
                           "not enabled (for data_efficiency curriculum metrics pass {metric name: fn})")
    engine.data_efficiency.curriculum.set_custom_get_difficulty(schedule)


class DataMethods:
    """``DeepSpeedEngine``'s data methods: the training loader and the data-efficiency accessors."""

    _config: Any
    data_efficiency: DataEfficiency | None

    def curriculum_enabled_legacy(self) -> bool:
        return self.data_efficiency is not None and self.data_efficiency.curriculum is not None

    def curriculum_learning_enabled(self) -> bool:
        """Whether ``data_efficiency.data_sampling.curriculum_learning`` (curriculum data sampling) is on."""
        return curriculum_sampling_enabled(self._config)

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """A function the training loader applies to each batch (DeepSpeed's data-efficiency hook, used by
        Megatron-DeepSpeed); without a training loader, nothing to set."""
        loader = getattr(self, "training_dataloader", None)
        if loader is not None:
            loader.post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Any) -> None:
        """``{metric: fn(step) -> difficulty}`` for curriculum metrics with ``schedule_type: custom`` (or, for the
        legacy ``curriculum_learning`` section, one ``fn``)."""
        set_custom_schedule(self, schedule_func_dict)

    @property
    def random_ltd_scheduler(self) -> Any:
        """The random-LTD ``RandomLTDScheduler`` (saved in checkpoints), or None."""
        return self.data_efficiency.random_ltd if self.data_efficiency is not None else None

    def random_ltd_enabled(self) -> bool:
        return self.data_efficiency is not None and self.data_efficiency.random_ltd is not None

    def random_ltd_initialize(self) -> None:
        """Give the model's ``RandomLayerTokenDrop`` layers the schedule (``convert_to_random_ltd`` calls it)."""
        from deepspeed.runtime.data_pipeline.data_routing.helper import random_ltd_initialize

        if not self.random_ltd_enabled():
            raise RuntimeError("random_ltd_initialize: data_efficiency.data_routing.random_ltd is not enabled")
        random_ltd_initialize(self.module, self.data_efficiency.random_ltd_config, self.data_efficiency.random_ltd)

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Any = None, num_local_io_workers: int | None = None) -> Any:
        """A ``DeepSpeedDataLoader`` over ``dataset``: this rank's shard, micro batches of the configured size."""
        from deepspeed.runtime.dataloader import DeepSpeedDataLoader

        if not isinstance(dataset, torch.utils.data.Dataset):
            raise TypeError(f"deepspeed_io: training data must be a torch.utils.data.Dataset, got "
                            f"{type(dataset).__name__}")
        rank = dist.get_rank(self.dp_group) if self.dp_world_size > 1 else 0
        dynamic = dynamic_batching_io(self, dataset, route, data_sampler, collate_fn)
        if dynamic is not None:  # data_efficiency.data_sampling.dynamic_batching: token-budget micro batches
            return DeepSpeedDataLoader(local_rank=self.local_rank, tput_timer=None, data_parallel_rank=rank,
                                       data_parallel_world_size=self.dp_world_size, **dynamic)
        return DeepSpeedDataLoader(dataset, batch_size or self.train_micro_batch_size_per_gpu(), pin_memory,
                                   self.local_rank, self.tput_timer if route == "train" else None,
                                   collate_fn=collate_fn,
                                   num_local_io_workers=num_local_io_workers, data_sampler=data_sampler,
                                   data_parallel_world_size=self.dp_world_size, data_parallel_rank=rank,
                                   dataloader_drop_last=self._config.dataloader_drop_last,
                                   deepspeed_dataloader_config=dataloader_config(self, route))
