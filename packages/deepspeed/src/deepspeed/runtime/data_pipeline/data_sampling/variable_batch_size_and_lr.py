"""Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``): variable batch size by token budget,
with the learning rate scaled by each batch's size.

Samples are packed in order (``sequence_picking_order``: dataset order, shuffled with the data-efficiency seed, or by
ascending length) into *micro batches*: runs of consecutive samples whose sequence lengths sum to at most
``max_tokens``, with between ``min_batch_size`` and ``max_batch_size`` samples (the longest run that fits is
taken). ``effective_batch_size`` consecutive micro batches (``train_batch_size`` of them: micro batch size x
gradient accumulation x data-parallel ranks) form one optimizer step's batch; trailing micro batches that cannot
fill a whole batch are dropped, as are samples longer than ``max_tokens`` (with a warning).

The data loader hands the micro batches of one step round-robin to the data-parallel ranks (a non-shuffling
``DistributedSampler``), ``micro_batch_size`` of them per loader batch, so every rank runs the same number of
steps. ``VariableBatchSizeLR`` wraps the LR schedule (or the optimizer's constant LR) and sets, before each step,
``lr = unscaled_lr * f(batch_samples / effective_batch_size)`` with f the identity (``linear``), the square root
(``sqrt``) or 1 (``none``): the reference LR belongs to a batch of one sample per micro batch.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from deepspeed.utils.logging import logger

SEQUENCE_PICKING_ORDERS = ("dataloader", "random", "seqlen")
LR_SCALING_METHODS = ("linear", "sqrt", "none")

__all__ = ["batch_by_seqlens", "scale_lr", "dataloader_for_variable_batch_size", "VariableBatchSizeLR",
           "lr_scheduler_for_variable_batch_size", "get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]


def _check_batching_args(max_tokens: int, min_batch_size: int, max_batch_size: int | None,
                         sequence_picking_order: str, effective_batch_size: int) -> None:
    for name, value in (("max_tokens", max_tokens), ("min_batch_size", min_batch_size),
                        ("effective_batch_size", effective_batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"batch_by_seqlens: {name}={value!r}; accepted: an int >= 1")
    if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < min_batch_size):
        raise ValueError(f"batch_by_seqlens: max_batch_size={max_batch_size!r}; accepted: None or an int >= "
                         f"min_batch_size ({min_batch_size})")
    if sequence_picking_order not in SEQUENCE_PICKING_ORDERS:
        raise ValueError(f"batch_by_seqlens: sequence_picking_order={sequence_picking_order!r}; accepted: "
                         f"{', '.join(SEQUENCE_PICKING_ORDERS)}")


def _ordered_samples(seqlens: Sequence[int], sample_ids: Sequence[int] | None, order: str, max_tokens: int,
                     seed: int | None) -> list[tuple[int, int]]:
    """``(seqlen, sample id)`` pairs in packing order, without the samples longer than ``max_tokens``."""
    lengths = np.asarray(seqlens).reshape(-1)
    ids = range(len(lengths)) if sample_ids is None else [int(i) for i in sample_ids]
    pairs = [(int(lengths[i]), i) for i in ids]
    if order == "random":
        random.Random(seed).shuffle(pairs)
    elif order == "seqlen":
        pairs.sort()
    too_long = [i for length, i in pairs if length > max_tokens]
    if too_long:
        logger.warning(f"dynamic batching: {len(too_long)} of {len(pairs)} samples are longer than max_tokens="
                       f"{max_tokens} and are left out (first ids: {too_long[:10]})")
        pairs = [p for p in pairs if p[0] <= max_tokens]
    return pairs


def _pack(pairs: list[tuple[int, int]], max_tokens: int, min_size: int, max_size: int | None,
          group: int) -> list[list[tuple[int, int]]]:
    """Micro batches of consecutive ``pairs``. With ``group`` > 1 each batch of ``n * group`` samples is dealt
    round-robin into ``group`` micro batches of ``n`` samples (equal sizes, for pipeline engines)."""

    def fits(batch: list[tuple[int, int]]) -> bool:
        parts = [batch[j::group] for j in range(group)]
        return all(sum(length for length, _ in part) <= max_tokens for part in parts) and \
            (max_size is None or len(parts[0]) <= max_size)

    micro_batches: list[list[tuple[int, int]]] = []
    start = 0
    while start < len(pairs):
        end = start + min_size * group
        if end > len(pairs) or not fits(pairs[start:end]):
            logger.warning(f"dynamic batching: the last {len(pairs) - start} samples cannot form {group} micro "
                           f"batch(es) of >= min_batch_size={min_size} samples within max_tokens={max_tokens}; "
                           "they are left out")
            break
        while end + group <= len(pairs) and fits(pairs[start:end + group]):
            end += group
        batch = pairs[start:end]
        micro_batches += [batch[j::group] for j in range(group)]
        start = end
    return micro_batches


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False,
                     seed: int | None = None) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """Pack samples into micro batches of at most ``max_tokens`` tokens (see the module doc).

    ``seqlens[i]`` is sample ``i``'s length (tokens); ``sequence_ids_per_mb`` restricts packing to those sample
    ids. Returns ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: ``(batch id, [sample ids])`` per micro
    batch, ``effective_batch_size`` micro batches per batch; then per batch its number of samples and its longest
    sample. With ``required_microbatches_of_same_size`` every micro batch of a batch has as many samples.
    """
    _check_batching_args(max_tokens, min_batch_size, max_batch_size, sequence_picking_order, effective_batch_size)
    pairs = _ordered_samples(seqlens, sequence_ids_per_mb, sequence_picking_order, max_tokens, seed)
    group = effective_batch_size if required_microbatches_of_same_size else 1
    micro_batches = _pack(pairs, max_tokens, min_batch_size, max_batch_size, group)
    if len(micro_batches) < effective_batch_size:
        raise ValueError(f"dynamic batching: the {len(pairs)} usable samples make {len(micro_batches)} micro "
                         f"batches, fewer than one batch of effective_batch_size={effective_batch_size} (lower "
                         "train_batch_size or max_tokens, or give more data)")
    micro_batches = micro_batches[:len(micro_batches) - len(micro_batches) % effective_batch_size]
    microbatch_ids, batch_sizes, batch_max_seqlens = [], [], []
    for batch_id in range(len(micro_batches) // effective_batch_size):
        parts = micro_batches[batch_id * effective_batch_size:(batch_id + 1) * effective_batch_size]
        microbatch_ids += [(batch_id, [i for _, i in part]) for part in parts]
        batch_sizes.append(sum(len(part) for part in parts))
        batch_max_seqlens.append(max(length for part in parts for length, _ in part))
        if verbose:
            logger.info(f"dynamic batching: batch {batch_id}: {batch_sizes[-1]} samples in {len(parts)} micro "
                        f"batches; samples per micro batch {[len(p) for p in parts]}, tokens per micro batch "
                        f"{[sum(n for n, _ in p) for p in parts]}, sample ids {[[i for _, i in p] for p in parts]}")
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1, method: str | None = "linear") -> float:
    """The learning rate for ``batch_size`` samples given ``base_lr`` for ``base_batch_size``: ``linear``
    (Goyal et al.: k times the batch, k times the LR), ``sqrt`` (Krizhevsky: sqrt(k) times) or ``none``."""
    if method is None or method.lower() == "none":
        return base_lr
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    raise ValueError(f"scale_lr: method={method!r}; accepted: {', '.join(LR_SCALING_METHODS)}")


class _MicrobatchIds(Dataset):
    """The ``(batch id, sample ids)`` micro batches as a map-style dataset (what the loader's sampler indexes)."""

    def __init__(self, microbatch_ids: Sequence[tuple[int, list[int]]]) -> None:
        self.items = list(microbatch_ids)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, list[int]]:
        return self.items[index]


class _CollateMicrobatches:
    """Collate function of the dynamic-batching loader: fetch the samples of the given micro batches (padded to
    their batch's longest sample when ``sample_padding_fn`` is set), then apply the user's collate function."""

    def __init__(self, dataset: Any, batch_max_seqlens: Sequence[int], collate_fn: Callable | None,
                 sample_padding_fn: Callable | None) -> None:
        self.dataset, self.batch_max_seqlens = dataset, list(batch_max_seqlens)
        self.collate_fn, self.sample_padding_fn = collate_fn, sample_padding_fn

    def __call__(self, entries: Sequence[tuple[int, list[int]]]) -> Any:
        samples = []
        for batch_id, sample_ids in entries:
            data = [self.dataset[i] for i in sample_ids]
            if self.sample_padding_fn is not None:
                longest = self.batch_max_seqlens[batch_id]
                data = [self.sample_padding_fn(sample, longest) for sample in data]
            samples += data
        return self.collate_fn(samples) if self.collate_fn is not None else samples


def dataloader_for_variable_batch_size(dataset: Any, microbatch_ids: Sequence[tuple[int, list[int]]],
                                       batch_max_seqlens: Sequence[int], dataloader_rank: int = 0,
                                       dataloader_batch_size: int = 1, dataloader_num_replicas: int = 1,
                                       dataloader_collate_fn: Callable | None = None,
                                       dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Callable | None = None) -> tuple[DataLoader, dict]:
    """This rank's loader over ``microbatch_ids`` (``dataloader_batch_size`` micro batches per loader batch) and
    the equivalent ``engine.deepspeed_io(**kwargs)`` keyword arguments. ``required_microbatches_of_same_seqlen``
    pads every sample to its batch's longest with ``sample_padding_fn(sample, seqlen)``."""
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise ValueError("dataloader_for_variable_batch_size: required_microbatches_of_same_seqlen=True needs "
                         "sample_padding_fn(sample, max_seqlen) -> padded sample")
    items = _MicrobatchIds(microbatch_ids)
    sampler = DistributedSampler(items, num_replicas=dataloader_num_replicas, rank=dataloader_rank, shuffle=False,
                                 drop_last=False)
    collate = _CollateMicrobatches(dataset, batch_max_seqlens, dataloader_collate_fn,
                                   sample_padding_fn if required_microbatches_of_same_seqlen else None)
    loader = DataLoader(items, batch_size=dataloader_batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=dataloader_num_workers, pin_memory=dataloader_pin_memory)
    kwargs = {"dataset": items, "batch_size": dataloader_batch_size, "pin_memory": dataloader_pin_memory,
              "data_sampler": sampler, "collate_fn": collate, "num_local_io_workers": dataloader_num_workers}
    return loader, kwargs


def _learning_rates(optimizer: Any) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


def _set_learning_rates(optimizer: Any, lrs: Sequence[float]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


class VariableBatchSizeLR(LRScheduler):
    """LR schedule that scales the wrapped schedule's LR (or, with ``lr_scheduler=None``, the optimizer's constant
    LR) by each step's batch size: ``scale_lr(base_batch_size, batch_sizes[step % len], lr, lr_scaling_method)``.

    ``step()`` restores the unscaled LR, steps the wrapped schedule, then scales for the next batch, so the wrapped
    schedule never sees a scaled LR. ``get_lr()`` is the LR in effect (scaled), ``get_last_lr()`` the wrapped
    schedule's unscaled one, as in DeepSpeed.
    """

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any = None,
                 lr_scaling_method: str = "linear", last_epoch: int = -1, verbose: bool = False,
                 optimizer: Any = None) -> None:
        # LRScheduler.__init__ is not called: it would reset the optimizer's LRs and hook optimizer.step
        if lr_scheduler is None and optimizer is None:
            raise ValueError("VariableBatchSizeLR: give lr_scheduler or optimizer")
        if not batch_sizes or base_batch_size < 1:
            raise ValueError(f"VariableBatchSizeLR: base_batch_size={base_batch_size} must be >= 1 and batch_sizes "
                             f"non-empty (got {len(batch_sizes)})")
        scale_lr(1, 1, 1.0, lr_scaling_method)  # reject an unknown method now, not at the first step
        self.base_lr_scheduler = lr_scheduler
        self._optimizer = optimizer if lr_scheduler is None else lr_scheduler.optimizer
        self.base_batch_size, self.batch_sizes = base_batch_size, list(batch_sizes)
        self.lr_scaling_method, self.dataloader, self.verbose = lr_scaling_method, dataloader, verbose
        self.base_lrs = _learning_rates(self._optimizer)
        self.unscaled_lrs = list(self.base_lrs)
        self.last_epoch = last_epoch + 1  # the batch about to run
        self._apply_scale()

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def _apply_scale(self) -> None:
        batch_size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        _set_learning_rates(self._optimizer, [scale_lr(self.base_batch_size, batch_size, lr, self.lr_scaling_method)
                                              for lr in self.unscaled_lrs])
        if self.verbose:
            logger.info(f"VariableBatchSizeLR: batch {self.last_epoch}: {batch_size} samples (reference "
                        f"{self.base_batch_size}), lr {self.unscaled_lrs} -> {self.get_lr()}")

    def step(self, epoch: int | None = None, **kwargs: Any) -> None:
        """Advance to the next batch (or to batch ``epoch``) and set its scaled LR."""
        _set_learning_rates(self._optimizer, self.unscaled_lrs)
        if self.base_lr_scheduler is not None:
            if epoch is None:
                self.base_lr_scheduler.step(**kwargs)
            else:
                self.base_lr_scheduler.step(epoch, **kwargs)
        self.unscaled_lrs = _learning_rates(self._optimizer)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        self._apply_scale()

    def get_lr(self) -> list[float]:
        return _learning_rates(self._optimizer)

    def get_last_lr(self) -> list[float]:
        if self.base_lr_scheduler is not None and hasattr(self.base_lr_scheduler, "get_last_lr"):
            return list(self.base_lr_scheduler.get_last_lr())
        return list(self.unscaled_lrs)

    def unwrap(self) -> Any:
        """Put the unscaled LR back in the optimizer and return the wrapped schedule (None: constant LR)."""
        _set_learning_rates(self._optimizer, self.unscaled_lrs)
        return self.base_lr_scheduler

    def state_dict(self) -> dict[str, Any]:
        base = self.base_lr_scheduler.state_dict() if self.base_lr_scheduler is not None else None
        return {"base_lr_scheduler": base, "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": list(self.batch_sizes),
                "base_lrs": list(self.base_lrs), "unscaled_lrs": list(self.unscaled_lrs),
                "last_epoch": self.last_epoch, "verbose": self.verbose}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and set the optimizer's LR for the restored batch."""
        if self.base_lr_scheduler is not None and state_dict.get("base_lr_scheduler") is not None:
            self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state_dict[key])
        unscaled = state_dict.get("unscaled_lrs")  # absent in DeepSpeed's checkpoints: ask the wrapped schedule
        if unscaled is None:
            unscaled = self.get_last_lr() if self.base_lr_scheduler is not None else self.base_lrs
        self.unscaled_lrs = list(unscaled)
        self._apply_scale()


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                                         lr_scheduler_or_optimizer: Any, lr_scaling_method: str = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """A ``VariableBatchSizeLR`` over a schedule (anything with ``.optimizer``) or an optimizer (constant LR)."""
    target = lr_scheduler_or_optimizer
    if isinstance(target, torch.optim.Optimizer) or hasattr(target, "param_groups"):  # an engine's optimizer too
        return VariableBatchSizeLR(None, base_batch_size, batch_sizes, dataloader, lr_scaling_method,
                                   verbose=verbose, optimizer=target)
    if hasattr(target, "optimizer") and hasattr(target, "step"):
        return VariableBatchSizeLR(target, base_batch_size, batch_sizes, dataloader, lr_scaling_method,
                                   verbose=verbose)
    raise TypeError(f"lr_scheduler_for_variable_batch_size: lr_scheduler_or_optimizer is a "
                    f"{type(target).__name__}; accepted: a torch optimizer or an LR schedule (with .optimizer)")


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Any, dataset_seqlens: Sequence[int], max_tokens: int, effective_batch_size: int,
        dataset_filter_ids: Sequence[int] | None = None, lr_scaling_method: str = "linear", min_batch_size: int = 1,
        max_batch_size: int | None = None, sequence_picking_order: str = "dataloader",
        dataloader_batch_size: int = 1, dataloader_rank: int = 0, dataloader_num_replicas: int = 1,
        dataloader_num_workers: int = 0, dataloader_collate_fn: Callable | None = None,
        dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer: Any = None,
        required_microbatches_of_same_size: bool = False, required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Callable | None = None, verbose: bool = False,
        seed: int | None = None) -> tuple[DataLoader, VariableBatchSizeLR | None, dict]:
    """Batch ``dataset`` by ``dataset_seqlens`` (:func:`batch_by_seqlens`), then build this rank's loader
    (:func:`dataloader_for_variable_batch_size`) and, given a schedule or optimizer, the LR scaling schedule."""
    per_loader_step = dataloader_batch_size * dataloader_num_replicas
    if effective_batch_size % per_loader_step:  # else batches straddle steps and the LR scale is off
        raise ValueError(f"dynamic batching: effective_batch_size={effective_batch_size} must be a multiple of "
                         f"dataloader_batch_size x dataloader_num_replicas = {per_loader_step} (the micro batches "
                         "one loader step takes over all ranks)")
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, dataset_filter_ids, min_batch_size, max_batch_size, sequence_picking_order,
        effective_batch_size, required_microbatches_of_same_size, verbose, seed)
    loader, kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank, dataloader_batch_size,
        dataloader_num_replicas, dataloader_collate_fn, dataloader_num_workers, dataloader_pin_memory,
        required_microbatches_of_same_seqlen, sample_padding_fn)
    scheduler = None
    if lr_scheduler_or_optimizer is not None:
        scheduler = lr_scheduler_for_variable_batch_size(effective_batch_size, batch_sizes, loader,
                                                         lr_scheduler_or_optimizer, lr_scaling_method, verbose)
    return loader, scheduler, kwargs


def _analyze_seqlens(dataset: Any, engine: Any, metrics_path: str, batch_seqlens_fn: Callable,
                     collate_fn: Callable | None) -> None:
    """Write ``<metrics_path>/seqlen/seqlen_sample_to_metric`` with the DataAnalyzer (every rank takes part)."""
    import torch.distributed as dist

    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer, DistributedDataAnalyzer

    common = {"batch_size": 1024, "metric_names": ["seqlen"], "metric_functions": [batch_seqlens_fn],
              "metric_types": ["single_value_per_sample"], "save_path": metrics_path, "collate_fn": collate_fn}
    if dist.is_available() and dist.is_initialized():
        DistributedDataAnalyzer(dataset, num_workers=dist.get_world_size(), worker_id=dist.get_rank(),
                                device=str(engine.device), **common).run_map_reduce()
    else:
        DataAnalyzer(dataset, metric_dtypes=[np.int64], **common).run_map_reduce()


def _dataset_seqlens(dataset: Any, engine: Any, batching: Any, batch_seqlens_fn: Callable | None,
                     collate_fn: Callable | None) -> np.ndarray:
    """Every sample's length from the configured DataAnalyzer file (written first when missing)."""
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    prefix = batching.seqlen_file_prefix()
    if prefix is None:
        raise ValueError("dynamic batching needs each sample's length: set data_efficiency.data_sampling."
                         "dynamic_batching.metrics_path (or seqlen_sample_to_metric_path), or pass dataset_seqlens")
    if not (os.path.exists(f"{prefix}.bin") and os.path.exists(f"{prefix}.idx")):
        if batch_seqlens_fn is None or batching.metrics_path is None:
            raise ValueError(f"dynamic batching: no sequence-length file at {prefix}(.bin/.idx); write it with the "
                             "DataAnalyzer (metric 'seqlen'), or set metrics_path and pass batch_seqlens_fn")
        logger.warning(f"dynamic batching: {prefix} not found; running the DataAnalyzer to write it")
        _analyze_seqlens(dataset, engine, batching.metrics_path, batch_seqlens_fn, collate_fn)
    lengths = MMapIndexedDataset(prefix, skip_warmup=True)
    if len(lengths) != len(dataset):
        raise ValueError(f"dynamic batching: {prefix} holds {len(lengths)} sequence lengths but the dataset has "
                         f"{len(dataset)} samples (delete the stale file if the dataset changed)")
    if np.any(np.asarray(lengths.sizes) != 1):
        raise ValueError(f"dynamic batching: {prefix} is not a sample -> length file (one value per sample); give "
                         "the DataAnalyzer's seqlen_sample_to_metric of a 'single_value_per_sample' metric")
    return lengths.concatenated().astype(np.int64)


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Any, engine: Any, dataset_seqlens: Sequence[int] | None = None,
        dataset_filter_ids: Sequence[int] | None = None, dataloader_collate_fn: Callable | None = None,
        sample_padding_fn: Callable | None = None,
        batch_seqlens_fn: Callable | None = None) -> tuple[DataLoader, VariableBatchSizeLR | None, dict]:
    """:func:`get_dataloader_and_lr_scheduler_for_variable_batch_size` configured from ``engine`` (its
    ``dynamic_batching`` section, batch sizes, data-parallel rank, schedule). Sample lengths: ``dataset_seqlens``,
    else the configured DataAnalyzer file, else that file written from ``batch_seqlens_fn(batch) -> lengths``.
    A pipeline engine gets micro batches of equal sample counts, padded with ``sample_padding_fn`` when given
    (without it, ``dataloader_collate_fn`` must make their shapes equal)."""
    from deepspeed.runtime.lr_schedules import get_torch_optimizer

    efficiency = engine._config.data_efficiency
    sampling = efficiency.data_sampling
    batching = sampling.dynamic_batching
    if not batching.enabled:
        raise ValueError("dynamic batching is not enabled: set data_efficiency.data_sampling.dynamic_batching."
                         "enabled to true (with max_tokens)")
    if dataset_seqlens is None:
        dataset_seqlens = _dataset_seqlens(dataset, engine, batching, batch_seqlens_fn, dataloader_collate_fn)
    schedule = engine.lr_scheduler
    if isinstance(schedule, VariableBatchSizeLR):  # built again (a second deepspeed_io): wrap the original
        schedule = schedule.unwrap()
    pipeline = bool(getattr(engine, "pipeline_parallelism", False))
    dp_rank = torch.distributed.get_rank(engine.dp_group) if engine.dp_world_size > 1 else 0
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, dataset_seqlens, batching.max_tokens, engine.train_batch_size(), dataset_filter_ids,
        batching.lr_scaling_method, batching.min_batch_size, batching.max_batch_size,
        batching.sequence_picking_order, engine.train_micro_batch_size_per_gpu(), dp_rank, engine.dp_world_size,
        sampling.num_workers, dataloader_collate_fn, sampling.pin_memory,
        schedule or (get_torch_optimizer(engine.optimizer) if engine.optimizer is not None else None),
        required_microbatches_of_same_size=pipeline,
        required_microbatches_of_same_seqlen=pipeline and sample_padding_fn is not None,
        sample_padding_fn=sample_padding_fn, verbose=batching.verbose, seed=efficiency.seed)
