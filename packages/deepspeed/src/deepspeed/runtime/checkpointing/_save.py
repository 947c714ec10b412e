"""``save_checkpoint``: every rank writes its files into ``<save_dir>/<tag>/``, then ``latest`` is updated.

Order (each arrow a meeting of all ranks, see ``_sync``): agree on the call and the tag -> write this rank's
files atomically -> agree that every rank's files are complete -> write ``latest`` -> agree it is written.
A rank that fails to write (disk full, a bad object) makes every rank raise and ``latest`` keeps naming
the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from deepspeed.__about__ import __version__
from deepspeed.runtime.checkpointing._atomic import atomic_write, atomic_write_text, make_dirs
from deepspeed.runtime.checkpointing._engine_adapter import as_engine_state
from deepspeed.runtime.checkpointing._errors import CheckpointError
from deepspeed.runtime.checkpointing._layout import (
    LATEST_FILE,
    default_tag,
    latest_writer,
    model_states_name,
    validate_tag,
    writer_rank,
)
from deepspeed.runtime.checkpointing._serialize import compact_for_save, module_state_dict, save_file
from deepspeed.runtime.checkpointing._state import EngineState, ShardContext, per_rank_model_states
from deepspeed.runtime.checkpointing._sync import Meeting, arrive, open_meeting
from deepspeed.runtime.checkpointing._tags import validate_tags

_OP = "save_checkpoint"


def model_states(state: EngineState, client_state: Mapping[str, Any] | None,
                 exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """The ``mp_rank_XX_model_states.pt`` payload, with DeepSpeed's keys; ``client_state`` merged on top."""
    counters, parallel = state.counters, state.parallel
    optimizer = None
    if state.optimizer is not None and not state.optimizer_in_shards():
        optimizer = compact_for_save(state.optimizer.state_dict())
    scheduler = None if state.lr_scheduler is None else compact_for_save(state.lr_scheduler.state_dict())
    payload: dict[str, Any] = {
        "module": None if state.module_in_shards() else _shared_module_state(state, exclude_frozen_parameters),
        "buffer_names": [name for name, _ in state.module.named_buffers()],
        "optimizer": optimizer,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
        "lr_scheduler": scheduler,
        "data_sampler": None if state.data_sampler is None else state.data_sampler.state_dict(),
        "random_ltd": None if state.random_ltd is None else state.random_ltd.state_dict(),
        "sparse_tensor_module_names": set(),
        "skipped_steps": counters.skipped_steps,
        "global_steps": counters.global_steps,
        "global_samples": counters.global_samples,
        "micro_steps": counters.micro_steps,
        "dp_world_size": parallel.dp_world_size,
        "mp_world_size": parallel.mp_world_size,
        "ds_config": state.ds_config,
        "ds_version": __version__,
    }
    for shard in state.shards:
        payload.update(shard.model_state_extras())
    payload.update(client_state or {})
    return payload


def _shared_module_state(state: EngineState, exclude_frozen_parameters: bool) -> dict[str, Any]:
    """The module's state dict minus what extensions keep in their own files (``strip_module_state``: MoE experts)."""
    weights = module_state_dict(state.module, exclude_frozen_parameters)
    for shard in state.shards:
        strip = getattr(shard, "strip_module_state", None)
        if strip is not None:
            weights = strip(weights)
    return weights


def _rank_files(state: EngineState, ctx: ShardContext, client_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{file name: object}`` this rank writes into the tag directory."""
    files: dict[str, Any] = {}
    per_rank = per_rank_model_states(state)
    if per_rank is not None:  # ZeRO-3: every data-parallel rank writes its own model-states file
        name = per_rank(state.parallel.dp_rank, state.parallel.mp_rank)
        files[name] = model_states(state, client_state, ctx.exclude_frozen_parameters)
    elif writer_rank(state.checkpoint_config, state.parallel) == 0:
        name = model_states_name(state.parallel.mp_rank)
        files[name] = model_states(state, client_state, ctx.exclude_frozen_parameters)
    for shard in state.shards:
        for name, obj in shard.files_to_save(ctx).items():
            if name in files or os.path.basename(name) != name:
                raise CheckpointError(f"checkpoint shard file name {name!r} from {type(shard).__name__} is "
                                      "taken or not a plain file name")
            files[name] = obj
    return files


def _write_rank_files(state: EngineState, ctx: ShardContext, client_state: Mapping[str, Any] | None) -> None:
    files = _rank_files(state, ctx, client_state)
    if files:
        make_dirs(ctx.tag_dir)
    for name, obj in files.items():
        save_file(obj, os.path.join(ctx.tag_dir, name))
    for shard in state.shards:  # plain files beside the tag dirs (ZeRO's zero_to_fp32.py), copied atomically
        copies = getattr(shard, "files_to_copy", None)
        for name, source in (copies(ctx) if copies is not None else {}).items():
            if os.path.basename(name) != name or name == LATEST_FILE:
                raise CheckpointError(f"checkpoint file name {name!r} from {type(shard).__name__} is not a plain "
                                      "file name or is taken")
            with open(source, "rb") as src:
                atomic_write(os.path.join(os.path.dirname(ctx.tag_dir), name),
                             lambda dst, src=src: shutil.copyfileobj(src, dst))


def _agree(meeting: Meeting | None, phase: str, error: BaseException | None, waiting_for: str, what: str) -> None:
    """Share each rank's outcome of ``phase``; raise on every rank if any rank failed."""
    if meeting is None:
        if error is not None:
            raise CheckpointError(f"{_OP}: {what} failed: {error}") from error
        return
    outcome = "ok" if error is None else f"{type(error).__name__}: {error}"
    statuses = meeting.exchange(phase, outcome, waiting_for)
    failed = {rank: status for rank, status in statuses.items() if status != "ok"}
    if failed:
        detail = "; ".join(f"rank {rank}: {status}" for rank, status in sorted(failed.items()))
        raise CheckpointError(f"{_OP} on rank {meeting.rank}: {what} failed on ranks {sorted(failed)} "
                              f"({detail})") from error


def check_save_dir(save_dir: object, op: str = _OP) -> str:
    """``save_dir`` as a ``str`` path; ``None``, ``""`` or a non-path is a ``ValueError`` naming the argument."""
    try:
        path = os.fsdecode(os.fspath(save_dir))  # type: ignore[arg-type]
    except TypeError:
        path = ""
    if not path:
        raise ValueError(f"{op}: save_dir={save_dir!r} is invalid; accepted: a non-empty directory path (str or "
                         "os.PathLike) under which <save_dir>/<tag>/ and <save_dir>/latest are written")
    return path


def save_checkpoint(state: EngineState | Any, save_dir: str | os.PathLike, tag: object = None,
                    client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """Save ``state`` under ``<save_dir>/<tag>/`` (tag default ``global_step<N>``); returns the tag directory.

    ``state``: an :class:`EngineState`, or an engine (see ``_engine_adapter``). Collective: every rank of
    ``state.sync.group`` must call it. ``client_state`` keys are stored at the top
    level of the model-states file and come back from ``load_checkpoint``. ``save_latest`` points
    ``<save_dir>/latest`` at the tag, after every rank's files are complete.
    """
    state = as_engine_state(state)
    problem: ValueError | None = None  # bad arguments: raised on every rank, after telling the others
    try:
        save_dir = check_save_dir(save_dir)
        tag = validate_tag(default_tag(state.counters.global_steps) if tag is None else tag)
    except ValueError as exc:  # CheckpointTagError is a ValueError too
        problem = exc
    meeting = open_meeting(_OP, state.sync)
    if meeting is not None:
        tags = arrive(meeting, _OP, None if problem else tag, problem)
        validate_tags(tags, state.checkpoint_config.tag_validation, meeting.rank)
    elif problem is not None:
        raise problem
    ctx = ShardContext(tag_dir=os.path.join(save_dir, tag), parallel=state.parallel,
                       config=state.checkpoint_config, exclude_frozen_parameters=exclude_frozen_parameters)
    error: BaseException | None = None
    try:
        _write_rank_files(state, ctx, client_state)
    except Exception as exc:  # shared with the other ranks below, then raised everywhere
        error = exc
    _agree(meeting, "written", error, f"finish writing {ctx.tag_dir}", f"writing {ctx.tag_dir} ('latest' unchanged)")
    error = None
    if save_latest and latest_writer(state.checkpoint_config, state.parallel):
        try:
            make_dirs(save_dir)
            atomic_write_text(os.path.join(save_dir, LATEST_FILE), tag)
        except Exception as exc:
            error = exc
    _agree(meeting, "latest", error, f"finish {_OP} (writing 'latest')", f"writing {save_dir}/{LATEST_FILE}")
    return ctx.tag_dir
