"""``load_checkpoint``: restore an :class:`EngineState` from ``<load_dir>/<tag>/`` (tag default: ``latest``).

Order (each arrow a meeting of all ranks, see ``_sync`` / ``_agreement``): agree on the call and the tag -> agree
that every rank has its model-states file -> every rank reads and checks all its files (``_restore``, no
collective) -> agree that all succeeded, else every rank raises :class:`CheckpointRankError` naming the rank, the
file and the cause, with nothing loaded -> apply (ZeRO's collectives) -> agree that applying succeeded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from deepspeed.checkpoint import universal as uc
from deepspeed.runtime.checkpointing._agreement import agree
from deepspeed.runtime.checkpointing._engine_adapter import as_engine_state
from deepspeed.runtime.checkpointing._restore import LoadOptions, prepare_restore
from deepspeed.runtime.checkpointing._state import EngineState, per_rank_model_states
from deepspeed.runtime.checkpointing._sync import check_same_call, open_meeting
from deepspeed.runtime.checkpointing._tags import validate_tags
from deepspeed.runtime.checkpointing.errors import CheckpointError, CorruptCheckpointError
from deepspeed.runtime.checkpointing.layout import LATEST_FILE, model_states_name, read_latest, validate_tag
from deepspeed.runtime.checkpointing.tp_resize import fallback_model_states_path
from deepspeed.utils.logging import logger

_OP = "load_checkpoint"
_NO_TAG = "<no usable tag>"  # posted by a rank whose tag argument or 'latest' file is unusable


def _stale_latest(load_dir: str, tag: str, universal: bool) -> CorruptCheckpointError:
    """``latest`` names a tag folder that does not exist: damaged (a truncated name) or left behind."""
    path = os.path.join(load_dir, uc.LATEST_UNIVERSAL if universal else LATEST_FILE)
    reason = (f"names tag {tag!r}, but {os.path.join(load_dir, tag)} does not exist (a damaged 'latest', or its "
              "checkpoint was removed); pass the tag to load explicitly")
    return CorruptCheckpointError(f"{path}: {reason}", path=path, reason=reason)


def _resolve_tag(load_dir: str, tag: object) -> str | None:
    if tag is not None:
        return validate_tag(tag)
    latest = read_latest(load_dir)  # a damaged file raises, naming it
    if latest is None:
        logger.warning(
            f"Unable to find latest file at {os.path.join(load_dir, LATEST_FILE)}, if trying to load latest "
            "checkpoint please ensure this file exists or pass an explicit checkpoint tag when loading a checkpoint."
        )
        return None
    return validate_tag(latest)


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
    from_latest, error = tag is None, None
    try:
        tag = uc.resolve_universal_tag(load_dir, tag) if universal else _resolve_tag(load_dir, tag)
    except Exception as exc:  # a damaged 'latest', a bad tag: reported by every rank in the agreement below
        tag, error = _NO_TAG, exc
    if tag is None:
        return None, None
    meeting = open_meeting(_OP, state.sync)
    if meeting is not None:
        arrivals = meeting.exchange("arrive", f"{_OP}|{tag}", f"call {_OP} (tag {tag!r})")
        tags = check_same_call(_OP, arrivals, meeting.rank)
        validate_tags(tags, state.checkpoint_config.tag_validation, meeting.rank)
    tag_dir = os.path.join(load_dir, tag)
    path = ""
    try:
        if error is not None:
            raise error
        if from_latest and not os.path.isdir(tag_dir):
            raise _stale_latest(load_dir, tag, universal)
        if universal:
            uc.check_universal_folder(tag_dir)
        path = (uc.universal_model_states_path(state, tag_dir, per_rank_model_states(state)) if universal
                else _model_states_path(state, tag_dir))
    except Exception as exc:  # e.g. not a universal folder: every rank learns it, none waits below
        error = exc
    agree(meeting, _OP, "locating files", error, "Nothing was loaded on any rank.")
    if meeting is not None:  # a rank-specific tag can leave some ranks without their file: fail together
        found = meeting.exchange("found", str(os.path.isfile(path)), f"check {path}")
        missing = sorted(r for r, v in found.items() if v == "False")
        if missing and len(missing) < len(found):
            raise CheckpointError(f"{_OP}: the model-states file of tag {tag!r} is missing on ranks {missing} but "
                                  "present on the others (rank-specific tags?); load one tag on every rank")
    if not os.path.isfile(path):
        logger.warning(f"Client provided checkpoint load path: {path} does not exist ... skip checkpoint load")
        return None, None
    opts = LoadOptions(load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only,
                       custom_load_fn)
    # (a) read and check every file this rank needs: no change to the model, no collective
    restore, error = None, None
    try:
        restore = prepare_restore(state, path, tag_dir, opts)
    except Exception as exc:  # shared with the other ranks below, then raised everywhere
        error = exc
    # (b) one exchange: every rank learns every failure before any rank enters a collective of the load
    agree(meeting, _OP, "reading", error, "Nothing was loaded on any rank; repair or replace the file, or load "
                                          "another tag.")
    # (c) apply (ZeRO's all-gathers happen here, on every rank together)
    error = None
    try:
        restore.apply()
    except Exception as exc:
        error = exc
    agree(meeting, _OP, "loading", error, "The files were read on every rank, but applying them failed: the model "
                                          "and optimizer may be partly loaded, load again.")
    consumed = restore.consumed
    if load_lr_scheduler_states:
        consumed.append("lr_scheduler")
    if load_optimizer_states:
        consumed.append("optimizer")
    return path, {key: value for key, value in restore.checkpoint.items() if key not in consumed}
