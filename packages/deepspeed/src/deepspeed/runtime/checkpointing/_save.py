"""``save_checkpoint``: every rank writes its files into ``<save_dir>/<tag>/``, then ``latest`` is updated.

Order (each arrow a meeting of all ranks, see ``_sync`` and ``_agreement``): agree on the call and the tag ->
write this rank's files (rank 0: and the new ``latest``) under temporary names, fsynced -> agree that every
rank's writes succeeded -> rename them into place -> agree -> rank 0 renames ``latest`` into place -> agree. A rank
that fails to write (ENOSPC, EACCES, EIO, an object torch cannot save) makes every rank raise
:class:`CheckpointRankError` naming the rank, the file and the cause; every rank removes its temporaries, so no
file of the tag directory changes (re-saving the tag a complete checkpoint already has leaves it loadable) and
``latest`` keeps naming the previous checkpoint. Speed: ``docs/checkpoint-speed.md``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from deepspeed.__about__ import __version__
from deepspeed.runtime.checkpointing._agreement import agree
from deepspeed.runtime.checkpointing._engine_adapter import as_engine_state
from deepspeed.runtime.checkpointing._state import EngineState, ShardContext, per_rank_model_states
from deepspeed.runtime.checkpointing._sync import arrive, open_meeting
from deepspeed.runtime.checkpointing._tags import validate_tags
from deepspeed.runtime.checkpointing.atomic import (
    Syncer,
    commit,
    discard,
    make_dirs,
    stage_write,
)
from deepspeed.runtime.checkpointing.errors import CheckpointError
from deepspeed.runtime.checkpointing.layout import (
    LATEST_FILE,
    default_tag,
    latest_writer,
    model_states_name,
    read_latest,
    validate_tag,
    writer_rank,
)
from deepspeed.runtime.checkpointing.serialize import (
    compact_for_save,
    module_state_dict,
    stage_file,
    with_deepspeed_objects,
)
from ds_zero.checkpoint import saved_config

_OP = "save_checkpoint"


def model_states(state: EngineState, client_state: Mapping[str, Any] | None,
                 exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """The ``mp_rank_XX_model_states.pt`` payload, with DeepSpeed's keys; ``client_state`` merged on top."""
    counters, parallel = state.counters, state.parallel
    optimizer = None
    if state.optimizer is not None and not state.optimizer_in_shards():
        optimizer = compact_for_save(state.optimizer.state_dict(), share_views=True)
    scheduler = (None if state.lr_scheduler is None
                 else compact_for_save(state.lr_scheduler.state_dict(), share_views=True))
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
        # the engine (the counters object) knows which embeddings train with sparse gradients
        "sparse_tensor_module_names": set(getattr(counters, "sparse_tensor_module_names", None) or ()),
        "skipped_steps": counters.skipped_steps,
        "global_steps": counters.global_steps,
        "global_samples": counters.global_samples,
        "micro_steps": counters.micro_steps,
        "dp_world_size": parallel.dp_world_size,
        "mp_world_size": parallel.mp_world_size,
        "ds_config": saved_config(state.ds_config),  # its non-default values, as DeepSpeed stores the user's dict
        "ds_version": __version__,
    }
    for shard in state.shards:
        payload.update(shard.model_state_extras())
    payload.update(client_state or {})
    return payload


def _shared_module_state(state: EngineState, exclude_frozen_parameters: bool) -> dict[str, Any]:
    """The module's state dict minus what extensions keep in their own files (``strip_module_state``: MoE experts)."""
    strips = [strip for strip in (getattr(shard, "strip_module_state", None) for shard in state.shards) if strip]
    # views of one flat buffer (ZeRO's parameters) stay views, unless stripping leaves part of the buffer unsaved
    weights = module_state_dict(state.module, exclude_frozen_parameters, share_views=not strips)
    for strip in strips:
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
            files[name] = with_deepspeed_objects(obj)
    for shard in state.shards:  # e.g. AutoEP+AutoTP folding: its layout recorded in the other extensions' files
        decorate = getattr(shard, "decorate_files", None)
        if decorate is not None:
            decorate(files)
    return files


def _stage_rank_files(state: EngineState, ctx: ShardContext, client_state: Mapping[str, Any] | None,
                      staged: list[tuple[str, str]], latest: list[tuple[str, str]], latest_tag: str | None) -> None:
    """Write this rank's files under temporary names, all fsynced on return; appends ``(temporary, final path)``
    to ``staged``, and with ``latest_tag`` the new ``latest`` file's to ``latest`` (renamed only after every rank
    committed). Each file's fsync runs in the background while the next one is serialized."""
    files = _rank_files(state, ctx, client_state)
    if files and not os.path.isdir(ctx.tag_dir):
        os.makedirs(ctx.tag_dir, exist_ok=True)  # its entry is made durable with the renames (_commit)
    with Syncer() as syncer:
        for name, obj in files.items():
            path = os.path.join(ctx.tag_dir, name)
            staged.append((stage_file(obj, path, syncer), path))
        for shard in state.shards:  # plain files beside the tag dirs (ZeRO's zero_to_fp32.py)
            copies = getattr(shard, "files_to_copy", None)
            for name, source in (copies(ctx) if copies is not None else {}).items():
                if os.path.basename(name) != name or name == LATEST_FILE:
                    raise CheckpointError(f"checkpoint file name {name!r} from {type(shard).__name__} is not a "
                                          "plain file name or is taken")
                path = os.path.join(os.path.dirname(ctx.tag_dir), name)
                with open(source, "rb") as src:
                    content = src.read()
                if _holds(path, content):  # the previous save's copy: rewriting it would change nothing
                    continue
                staged.append((stage_write(path, lambda dst, content=content: dst.write(content), syncer), path))
        if latest_tag is not None:  # written now, so its fsync overlaps the others'
            save_dir = os.path.dirname(ctx.tag_dir)
            make_dirs(save_dir)
            path = os.path.join(save_dir, LATEST_FILE)
            latest.append((stage_write(path, lambda dst: dst.write(latest_tag.encode("utf-8")), syncer), path))


def _holds(path: str, content: bytes) -> bool:
    """Whether the file at ``path`` exists with exactly ``content``."""
    try:
        if os.path.getsize(path) != len(content):
            return False
        with open(path, "rb") as handle:
            return handle.read() == content
    except OSError:
        return False


def _commit(staged: list[tuple[str, str]], folders: tuple[str, ...] = ()) -> None:
    """Rename every staged temporary into place, then make the renames durable (their folders and ``folders``,
    fsynced together)."""
    for tmp, path in staged:
        try:
            commit(tmp, path)
        except Exception as exc:
            exc.checkpoint_path = path  # type: ignore[attr-defined]
            raise
    with Syncer() as syncer:
        for folder in sorted({os.path.dirname(os.path.abspath(path)) for _, path in staged} | set(folders)):
            syncer.fsync_dir(folder)


def _discard(staged: list[tuple[str, str]]) -> None:
    for tmp, _ in staged:
        discard(tmp)


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
    # checked before the first meeting, so before any rank can create it
    new_folder = problem is None and not os.path.isdir(os.path.join(save_dir, tag))
    meeting = open_meeting(_OP, state.sync)
    if meeting is not None:
        tags = arrive(meeting, _OP, None if problem else tag, problem)
        validate_tags(tags, state.checkpoint_config.tag_validation, meeting.rank)
    elif problem is not None:
        raise problem
    ctx = ShardContext(tag_dir=os.path.join(save_dir, tag), parallel=state.parallel,
                       config=state.checkpoint_config, exclude_frozen_parameters=exclude_frozen_parameters)
    rank = state.parallel.global_rank
    previous = read_latest(save_dir) if os.path.isdir(save_dir) else None
    unchanged = f"'latest' still names {previous!r}" if previous is not None else "no 'latest' was written"
    # 1. every rank writes temporaries; nothing under a final name changes until all of them have succeeded
    staged: list[tuple[str, str]] = []
    latest: list[tuple[str, str]] = []  # the new 'latest' (rank 0), staged now, renamed in step 3
    writes_latest = save_latest and latest_writer(state.checkpoint_config, state.parallel)
    error: BaseException | None = None
    try:
        _stage_rank_files(state, ctx, client_state, staged, latest, tag if writes_latest else None)
    except Exception as exc:  # shared with the other ranks below, then raised everywhere
        error = exc
    try:
        agree(meeting, _OP, "writing", error, f"Nothing was committed on any rank; {unchanged}.", rank)
    except BaseException:
        _discard(staged + latest)
        if new_folder:  # leave no empty tag folder behind (the last rank to empty it removes it)
            with contextlib.suppress(OSError):
                os.rmdir(ctx.tag_dir)
        raise
    # 2. rename into place (cannot run out of space; fails only if the folder itself broke); a tag folder this
    # save created is made durable in its parent here too
    error = None
    try:
        _commit(staged, (save_dir,) if new_folder and os.path.isdir(ctx.tag_dir) else ())
    except Exception as exc:
        _discard(staged)
        error = exc
    try:
        agree(meeting, _OP, "committing", error, f"{ctx.tag_dir} may hold a mix of old and new files; {unchanged}.",
              rank)
    except BaseException:
        _discard(latest)
        raise
    # 3. only now does 'latest' move
    error = None
    if latest:
        try:
            _commit(latest)
        except Exception as exc:
            _discard(latest)
            exc.checkpoint_path = os.path.join(save_dir, LATEST_FILE)  # type: ignore[attr-defined]
            error = exc
    agree(meeting, _OP, "updating latest", error, f"The files of {ctx.tag_dir} are complete, but {unchanged}.", rank)
    return ctx.tag_dir
