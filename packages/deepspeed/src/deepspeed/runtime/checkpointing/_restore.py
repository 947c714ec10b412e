"""The two halves of a load: :func:`prepare_restore` reads and checks, the returned :class:`Restore` applies.

Why split: loading a rank's files can fail on that rank alone (a damaged or missing file, a tensor of the wrong
shape), while applying a ZeRO optimizer state enters collectives (all-gathers). So ``prepare_restore`` reads every
file this rank needs and checks it against the live model and partitions (keys, shapes) without changing anything
and without any collective; ``load_checkpoint`` then lets the ranks agree (``_agreement``) and only when all
succeeded calls :meth:`Restore.apply`, whose steps change the model, optimizer, scheduler and counters.

Extensions take part through optional methods of a ``CheckpointShards``: ``prepare_load(ctx, load)`` (and
``prepare_universal(ctx, load)`` for a Universal Checkpoint) read and check, then return the function that
applies. An extension without them is loaded by its ``load_files`` / ``load_universal`` at apply time, as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed.checkpoint import universal as uc
from deepspeed.runtime.checkpointing._state import EngineState, ShardContext
from deepspeed.runtime.checkpointing.checks import check_module_weights, content_error
from deepspeed.runtime.checkpointing.errors import CheckpointError
from deepspeed.runtime.checkpointing.serialize import load_file, materialize
from deepspeed.runtime.checkpointing.tp_resize import check_tp_resize
from deepspeed.utils.logging import logger

# keys the engine consumes; the rest of the file comes back as client state (as in DeepSpeed)
ENGINE_KEYS = ("module", "sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size",
               "mp_world_size", "data_sampler", "random_ltd", "micro_steps")
_REQUIRED_KEYS = ("module", "global_steps", "skipped_steps")


@dataclass(frozen=True)
class LoadOptions:
    """``load_checkpoint``'s options."""

    strict: bool = True
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    module_only: bool = False
    custom_load_fn: Callable[..., Any] | None = None


@dataclass
class Restore:
    """What :func:`prepare_restore` read: the model-states dict, the keys the engine used, the apply steps."""

    checkpoint: dict[str, Any]
    consumed: list[str]
    steps: list[Callable[[], None]] = field(default_factory=list)

    def apply(self) -> None:
        for step in self.steps:
            step()


def file_reader(tag_dir: str, trusted: bool) -> Callable[[str], Any]:
    """``load(name)``: ``load_file(<tag_dir>/<name>)``; its errors carry ``checkpoint_path`` for the report.

    ``load.mapped(name)`` reads the same file memory-mapped (``load_file(mmap=True)``), once per load however often
    it is asked for (the check phase and the apply phase share what was read): for readers that copy what they keep
    into live tensors or :func:`~deepspeed.runtime.checkpointing.serialize.materialize` it (ZeRO's optimizer files,
    the model-states file). Plain ``load`` returns objects of the caller's own.
    """
    mapped_files: dict[str, Any] = {}

    def load(name: str) -> Any:
        return load_file(os.path.join(tag_dir, name), trusted=trusted)

    def mapped(name: str) -> Any:
        path = os.path.abspath(os.path.join(tag_dir, name))
        if path not in mapped_files:
            mapped_files[path] = load_file(path, trusted=trusted, mmap=True)
        return mapped_files[path]

    load.mapped = mapped  # type: ignore[attr-defined]
    return load


def read_model_states(state: EngineState, path: str, load: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """The model-states file at ``path`` (through ``load.mapped`` when given), checked for DeepSpeed's keys."""
    mapped = getattr(load, "mapped", None)
    checkpoint = mapped(path) if mapped is not None else load_file(path, trusted=state.trusted_load)
    if not isinstance(checkpoint, dict):
        raise content_error(path, f"holds a {type(checkpoint).__name__}, not a DeepSpeed model-states dict")
    missing = [key for key in _REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise content_error(path, f"missing keys {missing}: not a DeepSpeed model-states file (found "
                                  f"{sorted(map(str, checkpoint))[:12]})")
    for key in ("global_steps", "skipped_steps", "global_samples", "micro_steps"):
        if key in checkpoint and not isinstance(checkpoint[key], (int, torch.Tensor)):
            raise content_error(path, f"key {key!r} holds a {type(checkpoint[key]).__name__}, not a step count")
    return checkpoint


def _load_module(state: EngineState, checkpoint: dict[str, Any], weights: dict[str, Any], opts: LoadOptions,
                 path: str) -> None:
    """The weights into the model: through the engine's ``load_module_state_dict`` when the state has one (an
    engine subclass may override it), with ``checkpoint`` as read but ``module`` completed by the extensions."""
    hook = state.load_module_state_dict
    if opts.custom_load_fn is not None and hook is None:
        opts.custom_load_fn(src=weights, dst=state.module)
        return
    try:
        if hook is not None:
            hook({**checkpoint, "module": weights}, strict=opts.strict, custom_load_fn=opts.custom_load_fn)
        else:
            state.module.load_state_dict(weights, strict=opts.strict)
    except CheckpointError:
        raise
    except RuntimeError as exc:
        if opts.custom_load_fn is not None:  # the caller's function: its errors are its own
            raise
        raise CheckpointError(f"{path}: the saved module weights do not fit the model: {exc}") from exc


def _restore_training_state(state: EngineState, checkpoint: dict[str, Any], opts: LoadOptions, path: str) -> None:
    universal = state.checkpoint_config.load_universal  # ZeRO-0's optimizer then comes from zero/ (prepare)
    if opts.optimizer_states and state.optimizer is not None and not state.optimizer_in_shards() and not universal:
        if checkpoint.get("optimizer") is None:
            logger.warning(f"{path} holds no optimizer state; the optimizer keeps its current state")
        else:
            state.optimizer.load_state_dict(checkpoint["optimizer"])
    if opts.lr_scheduler_states and state.lr_scheduler is not None and checkpoint.get("lr_scheduler") is not None:
        state.lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
    for part in ("data_sampler", "random_ltd"):  # data efficiency: continue the same batches and token schedule
        if getattr(state, part) is not None and checkpoint.get(part) is not None:
            getattr(state, part).load_state_dict(checkpoint[part])
    counters = state.counters
    counters.global_steps = int(checkpoint["global_steps"])
    batch = state.ds_config.get("train_batch_size")
    batch = batch if isinstance(batch, int) else 0  # absent or "auto": no way to rebuild the sample count
    counters.global_samples = int(checkpoint.get("global_samples", counters.global_steps * batch))
    counters.skipped_steps = int(checkpoint["skipped_steps"])
    if "micro_steps" in checkpoint:  # files written by DeepSpeed itself lack it; DeepSpeed leaves the counter
        counters.micro_steps = int(checkpoint["micro_steps"])
    if hasattr(counters, "sparse_tensor_module_names"):
        _restore_sparse_names(state, checkpoint, opts.strict)


def _restore_sparse_names(state: EngineState, checkpoint: dict[str, Any], strict: bool) -> None:
    """DeepSpeed's rule: a strict load takes the saved set; a non-strict one keeps this model's sparse weights
    unless the checkpoint holds that weight as dense, and adds the saved sparse names this model has."""
    saved = checkpoint.get("sparse_tensor_module_names", checkpoint.get("csr_tensor_module_names"))
    if saved is None:
        return
    counters = state.counters
    if strict:
        counters.sparse_tensor_module_names = set(saved)
        return
    saved_weights = checkpoint.get("module") or {}
    own = dict(state.module.named_parameters())
    kept = {name for name in counters.sparse_tensor_module_names if name not in saved_weights or name in saved}
    counters.sparse_tensor_module_names = kept | {name for name in saved if name in own}


def _shard_step(shard: Any, ctx: ShardContext, load: Callable[[str], Any]) -> Callable[[], None]:
    """Read and check ``shard``'s files now when it can (``prepare_*``); the step that applies them."""
    if ctx.config.load_universal:
        prepare = getattr(shard, "prepare_universal", None)
        return prepare(ctx, load) if prepare is not None else (lambda: uc.load_universal_shard(shard, ctx, load))
    prepare = getattr(shard, "prepare_load", None)
    return prepare(ctx, load) if prepare is not None else (lambda: shard.load_files(ctx, load))


def prepare_restore(state: EngineState, path: str, tag_dir: str, opts: LoadOptions) -> Restore:
    """Read and check everything this rank loads from ``tag_dir`` (model states at ``path``, extension files);
    changes nothing and enters no collective. Returns the :class:`Restore` that applies it."""
    load = file_reader(tag_dir, state.trusted_load)
    mapped = read_model_states(state, path, load)
    # The weights only pass through load_state_dict (a copy into the live parameters), so they may stay views of
    # the mapped file; everything else may be kept (the optimizer's state, the client state): copied out
    keep_mapped = ("module",) if opts.custom_load_fn is None else ()
    checkpoint = {key: value if key in keep_mapped else materialize(value) for key, value in mapped.items()}
    universal = state.checkpoint_config.load_universal
    if not universal:  # a universal checkpoint loads at any tensor-parallel size
        check_tp_resize(state, checkpoint, path, opts.optimizer_states, opts.module_only)
    restore = Restore(checkpoint, ["module"])
    if not state.module_in_shards():
        weights = checkpoint["module"]
        for shard in state.shards:  # weights kept in the extension's own files (MoE experts) join the rest
            complete = getattr(shard, "complete_module_state", None)
            if complete is not None:
                weights = complete(dict(weights), load)
        if opts.custom_load_fn is None:
            check_module_weights(state.module, weights, opts.strict, path)
        restore.steps.append(lambda: _load_module(state, checkpoint, weights, opts, path))
    if not opts.module_only:
        restore.steps.append(lambda: _restore_training_state(state, checkpoint, opts, path))
        restore.consumed = list(ENGINE_KEYS)
    ctx = ShardContext(tag_dir=tag_dir, parallel=state.parallel, config=state.checkpoint_config,
                       load_optimizer_states=opts.optimizer_states, load_module_only=opts.module_only,
                       load_module_strict=opts.strict, custom_load_fn=opts.custom_load_fn)
    if universal:  # AutoTP: full universal values read back as this rank's shards
        for shard in state.shards:
            load = getattr(shard, "universal_reader", lambda inner: inner)(load)
        if opts.optimizer_states and not opts.module_only:
            restore.steps.append(lambda load=load: uc.load_stage0_universal(state, ctx, load))
    restore.steps.extend(_shard_step(shard, ctx, load) for shard in state.shards)
    return restore
