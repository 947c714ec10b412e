"""Loading a Universal Checkpoint (``checkpoint.load_universal: true``): the pieces ``load_checkpoint`` uses.

The tag comes from ``<load_dir>/latest_universal`` (written by ``ds_to_universal``) when none is given; the tag
folder must hold ``zero/`` (one folder per parameter). The model-states file is this rank's own ZeRO-3 file when
present, else ``mp_rank_XX_model_states.pt``, else rank 0's ZeRO-3 file, so a checkpoint converted from any stage
loads under any stage. Each ``CheckpointShards`` extension restores its partitions with ``load_universal(ctx,
load)`` (ds-zero's shard classes), reading only the parameters it holds; without ZeRO the optimizer's state is
rebuilt from the ``zero/`` folders by parameter name (:func:`load_stage0_universal`). An AutoTP rank of a larger
TP size than the converted checkpoint's reads ``mp_rank_00`` (full weights) and cuts its shards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepspeed.runtime.checkpointing.errors import CheckpointError
from deepspeed.runtime.checkpointing.layout import model_states_name, read_latest, validate_tag
from deepspeed.runtime.checkpointing.tp_resize import fallback_model_states_path

LATEST_UNIVERSAL = "latest_universal"
ZERO_FOLDER = "zero"


def resolve_universal_tag(load_dir: str, tag: object) -> str:
    if tag is not None:
        return validate_tag(tag)
    tag = read_latest(load_dir, LATEST_UNIVERSAL)  # a damaged file raises, naming it
    if tag is None:
        latest = os.path.join(load_dir, LATEST_UNIVERSAL)
        raise CheckpointError(f"Invalid for universal checkpoint: {latest} does not exist (checkpoint.load_universal "
                              "is true: convert a checkpoint with ds_to_universal, which writes it, or pass the tag)")
    return tag


def check_universal_folder(tag_dir: str) -> None:
    zero = os.path.join(tag_dir, ZERO_FOLDER)
    if not os.path.isdir(zero):
        what = "does not exist" if not os.path.isdir(tag_dir) else f"has no {ZERO_FOLDER}/ folder ({zero} is missing)"
        raise CheckpointError(f"checkpoint.load_universal is true but {tag_dir} is not a Universal Checkpoint: it "
                              f"{what}; a universal checkpoint holds {ZERO_FOLDER}/<parameter name>/fp32.pt, "
                              "exp_avg.pt, exp_avg_sq.pt. Convert it with `ds_to_universal --input_folder <tag folder> "
                              "--output_folder <new folder>`, or set checkpoint.load_universal to false")


def universal_model_states_path(state: Any, tag_dir: str, per_rank: Callable[[int, int], str] | None) -> str:
    mp_rank = state.parallel.mp_rank
    candidates = [model_states_name(mp_rank)]
    if per_rank is not None:
        candidates.insert(0, per_rank(state.parallel.dp_rank, mp_rank))
    candidates.append(f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt")
    for name in candidates:
        if os.path.isfile(os.path.join(tag_dir, name)):
            return os.path.join(tag_dir, name)
    # an AutoTP rank of a larger TP size than the converted checkpoint's: mp_rank_00 holds the full weights
    return fallback_model_states_path(state, tag_dir, os.path.join(tag_dir, candidates[-1]))


def load_universal_shard(shard: Any, ctx: Any, load: Callable[[str], Any]) -> None:
    restore = getattr(shard, "load_universal", None)
    if restore is None:
        raise CheckpointError(f"{type(shard).__name__} cannot restore its state from the Universal Checkpoint "
                              f"{ctx.tag_dir}; load a checkpoint saved with the same parallel layout instead")
    restore(ctx, load)


def load_stage0_universal(state: Any, ctx: Any, load: Callable[[str], Any]) -> None:
    """Without ZeRO (an ``FP32Optimizer`` wrapper): the optimizer's state from the ``zero/<name>/`` folders of its
    parameters (by name, so any tensor-parallel size: ``load`` cuts AutoTP shards); ZeRO restores its own."""
    found = stage0_optimizer(state.optimizer, state.module)
    if found is not None:
        load_stage0_optimizer(*found, ctx, load)


def stage0_optimizer_state(ctx: Any, load: Callable[[str], Any], names: list[str], params: list[Any],
                           current_groups: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The wrapped optimizer's state dict of a ZeRO-0 (``FP32Optimizer``) engine, read from the universal folders of
    ``names`` (one per entry of ``params``, in the optimizer's order), and the folders' common state. The saved
    hyper-parameters of each group are kept; its ``params`` indices are the current optimizer's."""
    from ds_zero.checkpoint import check_universal_folders, read_universal, read_universal_common, universal_keys

    check_universal_folders(ctx.tag_dir, list(names))
    common = read_universal_common(ctx, load)
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(zip(names, params, strict=True)):
        entry = {key: read_universal(ctx, load, name, key, param.numel()).view(param.shape)
                 for key in universal_keys(ctx.tag_dir, [name], True) if key != "fp32"}
        step = os.path.join("zero", name, "step.pt")
        if entry and os.path.isfile(os.path.join(ctx.tag_dir, step)):
            entry["step"] = load(step)
        if entry:
            state[i] = entry
    saved = common.get("param_groups") or current_groups
    if len(saved) != len(current_groups):
        raise CheckpointError(f"{ctx.tag_dir}: the checkpoint's optimizer has {len(saved)} parameter groups, this "
                              f"one {len(current_groups)}")
    groups = [{**{k: v for k, v in old.items() if k != "params"}, "params": now["params"]}
              for old, now in zip(saved, current_groups, strict=True)]
    return {"state": state, "param_groups": groups}, common


def stage0_optimizer(wrapper: Any, module: torch.nn.Module) -> tuple[Any, list[torch.nn.Parameter], list[str]] | None:
    """(wrapper, its model parameters in state order, their names in ``module``) of a ZeRO-0 optimizer wrapper
    (``FP32Optimizer``), else None (no optimizer, or ZeRO: its own files and universal load)."""
    from deepspeed.runtime.precision.optimizers import FP32Optimizer

    if not isinstance(wrapper, FP32Optimizer):
        return None
    params = getattr(wrapper, "model_params", None)
    params = list(params) if params is not None else [p for g in wrapper.optimizer.param_groups for p in g["params"]]
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return wrapper, params, [names[id(p)] for p in params]


def load_stage0_optimizer(wrapper: Any, params: Sequence[torch.nn.Parameter], names: Sequence[str], ctx: Any,
                          load: Any) -> None:
    """Fill a ZeRO-0 optimizer wrapper (``FP32Optimizer``) from the ``zero/<name>/`` folders: ``load`` (the AutoTP
    universal reader) returns this rank's shard of each value and moment; mixed-precision masters take fp32.pt."""
    from ds_zero.checkpoint import read_universal

    masters = getattr(wrapper, "master_of", {})
    for name, param in zip(names, params, strict=True):
        if param in masters:
            with torch.no_grad():
                masters[param].copy_(read_universal(ctx, load, name, "fp32", param.numel()).view(param.shape))
    optimizer_state, common = stage0_optimizer_state(ctx, load, list(names), list(params),
                                                     wrapper.optimizer.state_dict()["param_groups"])
    restored: dict[str, Any] = {"optimizer_state_dict": optimizer_state}
    if common.get("loss_scaler"):
        restored["loss_scaler"] = common["loss_scaler"]
    wrapper.load_state_dict(restored)
