"""``load_checkpoint``: restore an :class:`EngineState` from ``<load_dir>/<tag>/`` (tag default: ``latest``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from deepspeed.checkpoint import universal as uc
from deepspeed.runtime.checkpointing._engine_adapter import as_engine_state
from deepspeed.runtime.checkpointing._errors import CheckpointError, CorruptCheckpointError
from deepspeed.runtime.checkpointing._layout import LATEST_FILE, model_states_name, read_latest, validate_tag
from deepspeed.runtime.checkpointing._serialize import load_file
from deepspeed.runtime.checkpointing._state import EngineState, ShardContext, per_rank_model_states
from deepspeed.runtime.checkpointing._sync import check_same_call, open_meeting
from deepspeed.runtime.checkpointing._tags import validate_tags
from deepspeed.runtime.checkpointing._tp_resize import check_tp_resize, fallback_model_states_path
from deepspeed.utils.logging import logger

_OP = "load_checkpoint"
# keys the engine consumes; the rest of the file comes back as client state (as in DeepSpeed)
_ENGINE_KEYS = ("module", "sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size",
                "mp_world_size", "data_sampler", "random_ltd", "micro_steps")
_REQUIRED_KEYS = ("module", "global_steps", "skipped_steps")


def _resolve_tag(load_dir: str, tag: object) -> str | None:
    if tag is not None:
        return validate_tag(tag)
    latest = read_latest(load_dir)
    if latest is None:
        logger.warning(
            f"Unable to find latest file at {os.path.join(load_dir, LATEST_FILE)}, if trying to load latest "
            "checkpoint please ensure this file exists or pass an explicit checkpoint tag when loading a checkpoint."
        )
        return None
    return validate_tag(latest)


def _load_module(state: EngineState, weights: dict[str, Any], strict: bool, custom_load_fn: Callable | None,
                 path: str) -> None:
    if custom_load_fn is not None:
        custom_load_fn(src=weights, dst=state.module)
        return
    try:
        state.module.load_state_dict(weights, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: the saved module weights do not fit the model: {exc}") from exc


def _restore_training_state(state: EngineState, checkpoint: dict[str, Any], load_optimizer_states: bool,
                            load_lr_scheduler_states: bool, path: str) -> None:
    universal = state.checkpoint_config.load_universal  # ZeRO-0's optimizer then comes from zero/ (_restore)
    if load_optimizer_states and state.optimizer is not None and not state.optimizer_in_shards() and not universal:
        if checkpoint.get("optimizer") is None:
            logger.warning(f"{path} holds no optimizer state; the optimizer keeps its current state")
        else:
            state.optimizer.load_state_dict(checkpoint["optimizer"])
    if load_lr_scheduler_states and state.lr_scheduler is not None and checkpoint.get("lr_scheduler") is not None:
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


def _model_states_path(state: EngineState, tag_dir: str) -> str:
    """``mp_rank_XX_model_states.pt``, or with ZeRO-3 this rank's own file (rank 0's when the checkpoint was
    saved by fewer ranks: buffers and counters are the same in every rank's file)."""
    per_rank = per_rank_model_states(state)
    if per_rank is None:  # an AutoTP rank a smaller TP size wrote no file for reads mp_rank_00's full weights
        own = os.path.join(tag_dir, model_states_name(state.parallel.mp_rank))
        return fallback_model_states_path(state, tag_dir, own)
    own = os.path.join(tag_dir, per_rank(state.parallel.dp_rank, state.parallel.mp_rank))
    first = os.path.join(tag_dir, per_rank(0, state.parallel.mp_rank))
    # rank 0's file stands in only when it exists: a missing tag is reported with this rank's own file name
    return first if not os.path.isfile(own) and os.path.isfile(first) else own


def _read_model_states(state: EngineState, path: str) -> dict[str, Any]:
    checkpoint = load_file(path, trusted=state.trusted_load)
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(checkpoint).__name__}, not a DeepSpeed model-states dict")
    missing = [key for key in _REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise CorruptCheckpointError(f"{path} is not a DeepSpeed model-states file: keys {missing} are missing "
                                     f"(found {sorted(checkpoint)[:12]})")
    return checkpoint


def load_checkpoint(state: EngineState | Any, load_dir: str | os.PathLike, tag: object = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    custom_load_fn: Callable[..., Any] | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """Load ``<load_dir>/<tag>/mp_rank_XX_model_states.pt`` (and extension shards) into ``state``.

    Returns ``(path of the model-states file, client_state)``; ``(None, None)`` with a warning when there is no
    ``latest`` file (and no tag) or the file does not exist. ``load_module_only`` restores the weights alone;
    ``custom_load_fn(src=state_dict, dst=module)`` replaces ``module.load_state_dict``. Collective like saving.
    ``state``: an :class:`EngineState`, or an engine (its counters are updated in place).
    """
    state = as_engine_state(state)
    universal = state.checkpoint_config.load_universal  # a ds_to_universal folder, onto any layout
    load_dir = os.fspath(load_dir)
    tag = uc.resolve_universal_tag(load_dir, tag) if universal else _resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    meeting = open_meeting(_OP, state.sync)
    if meeting is not None:
        arrivals = meeting.exchange("arrive", f"{_OP}|{tag}", f"call {_OP} (tag {tag!r})")
        tags = check_same_call(_OP, arrivals, meeting.rank)
        validate_tags(tags, state.checkpoint_config.tag_validation, meeting.rank)
    tag_dir = os.path.join(load_dir, tag)
    if universal:
        uc.check_universal_folder(tag_dir)
    path = (uc.universal_model_states_path(state, tag_dir, per_rank_model_states(state)) if universal
            else _model_states_path(state, tag_dir))
    if meeting is not None:  # a rank-specific tag can leave some ranks without their file: fail together
        found = meeting.exchange("found", str(os.path.isfile(path)), f"check {path}")
        missing = sorted(r for r, v in found.items() if v == "False")
        if missing and len(missing) < len(found):
            raise CheckpointError(f"{_OP}: the model-states file of tag {tag!r} is missing on ranks {missing} but "
                                  "present on the others (rank-specific tags?); load one tag on every rank")
    if not os.path.isfile(path):
        logger.warning(f"Client provided checkpoint load path: {path} does not exist ... skip checkpoint load")
        return None, None
    error: BaseException | None = None
    try:
        checkpoint, consumed = _restore(state, path, tag_dir, load_module_strict, load_optimizer_states,
                                        load_lr_scheduler_states, load_module_only, custom_load_fn)
    except Exception as exc:  # shared with the other ranks below, then raised everywhere
        error = exc
    _agree_loaded(meeting, error, tag_dir)
    if load_lr_scheduler_states:
        consumed.append("lr_scheduler")
    if load_optimizer_states:
        consumed.append("optimizer")
    return path, {key: value for key, value in checkpoint.items() if key not in consumed}


def _restore(state: EngineState, path: str, tag_dir: str, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool,
             custom_load_fn: Callable[..., Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Read the model states and every extension's files into ``state``; returns the checkpoint and the keys used."""
    def load(name: str) -> Any:
        return load_file(os.path.join(tag_dir, name), trusted=state.trusted_load)

    checkpoint = _read_model_states(state, path)
    if not state.checkpoint_config.load_universal:  # a universal checkpoint loads at any tensor-parallel size
        check_tp_resize(state, checkpoint, path, load_optimizer_states, load_module_only)  # before any change
    if not state.module_in_shards():
        weights = checkpoint["module"]
        for shard in state.shards:  # weights kept in the extension's own files (MoE experts) join the rest
            complete = getattr(shard, "complete_module_state", None)
            if complete is not None:
                weights = complete(dict(weights), load)
        _load_module(state, weights, load_module_strict, custom_load_fn, path)
    consumed = ["module"]
    if not load_module_only:
        _restore_training_state(state, checkpoint, load_optimizer_states, load_lr_scheduler_states, path)
        consumed = list(_ENGINE_KEYS)
    ctx = ShardContext(tag_dir=tag_dir, parallel=state.parallel, config=state.checkpoint_config,
                       load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                       load_module_strict=load_module_strict, custom_load_fn=custom_load_fn)
    if ctx.config.load_universal:  # AutoTP: full universal values read back as this rank's shards
        for shard in state.shards:
            load = getattr(shard, "universal_reader", lambda inner: inner)(load)
        if load_optimizer_states and not load_module_only:
            uc.load_stage0_universal(state, ctx, load)
    for shard in state.shards:
        if ctx.config.load_universal:
            uc.load_universal_shard(shard, ctx, load)
        else:
            shard.load_files(ctx, load)
    return checkpoint, consumed


def _agree_loaded(meeting: Any, error: BaseException | None, tag_dir: str) -> None:
    """Every rank fails when any rank could not load its part (one rank going on alone would hang the others)."""
    if meeting is None:
        if error is not None:
            raise error
        return
    outcome = "ok" if error is None else f"{type(error).__name__}: {error}"
    statuses = meeting.exchange("loaded", outcome, f"finish loading {tag_dir}")
    failed = {rank: status for rank, status in statuses.items() if status != "ok"}
    if error is not None:
        raise error
    if failed:
        detail = "; ".join(f"rank {rank}: {status}" for rank, status in sorted(failed.items()))
        raise CheckpointError(f"{_OP} on rank {meeting.rank}: loading {tag_dir} failed on ranks {sorted(failed)} "
                              f"({detail}); this rank's model may be partly loaded, load again")
