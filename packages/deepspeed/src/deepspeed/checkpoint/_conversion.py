"""The reading and writing pieces that ``ds_to_universal`` and its AutoTP converter (``autotp_universal``) share:
the universal format's constants, the ZeRO rank files of one tensor-parallel rank, lazily read optimizer states, and
the atomic writes and final check of the output."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from deepspeed.runtime.checkpointing.atomic import atomic_write

PARAM = "param"
CAT_DIM = "cat_dim"
PARAM_GROUPS = "param_groups"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
_SHARDED_12 = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups", "zero_layout",
               "group_paddings")
_SHARDED_3 = ("fp32_flat_groups", "zero_layout")


class UniversalConversionError(ValueError):
    """The input folder cannot be converted (not a ZeRO checkpoint, incomplete, missing state)."""


def _progress(items: Sequence[str], desc: str) -> Iterable[str]:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional here
        return items
    return tqdm(items, desc=desc, unit="param")


def _save(path: str, obj: Any) -> None:
    atomic_write(path, lambda handle: torch.save(obj, handle))


def _copy(src: str, dst: str) -> None:
    with open(src, "rb") as source:
        atomic_write(dst, lambda handle: shutil.copyfileobj(source, handle, 16 << 20))


def _files_of_mp_rank(tag_dir: str, pattern: Any, mp_rank: int) -> dict[int | None, str]:
    """``{dp rank (None when absent): path}`` of model-parallel rank ``mp_rank``'s files matching ``pattern``."""
    found: dict[int | None, str] = {}
    for name in sorted(os.listdir(tag_dir)):
        match = pattern.match(name)
        if match is not None and int(match.group(2)) == mp_rank:
            found[None if match.group(1) is None else int(match.group(1))] = os.path.join(tag_dir, name)
    return found


def _mp_ranks(tag_dir: str) -> list[int]:
    """The model-parallel ranks (pipeline stages) that wrote optimizer files."""
    from ds_zero import zero_to_fp32 as z

    ranks = {int(m.group(2)) for m in map(z.OPTIM_STATES_RE.match, os.listdir(tag_dir)) if m is not None}
    return sorted(ranks)


def _rank_sections(tag_dir: str, mp_rank: int = 0) -> tuple[int, int, list[Mapping[str, Any]], list[str]]:
    """(stage, world, every rank's memory-mapped ``optimizer_state_dict``, the files) of one model-parallel rank."""
    from ds_zero import zero_to_fp32 as z

    files = _files_of_mp_rank(tag_dir, z.OPTIM_STATES_RE, mp_rank)
    if not files:
        raise UniversalConversionError(f"{tag_dir}: no zero_pp_rank_<r>_mp_rank_{mp_rank:02d}_optim_states.pt files; "
                                       "only ZeRO stage 1/2/3 checkpoint tag folders can be converted")
    first = files[min(files)]
    section = z.optimizer_section(z.load_checkpoint_file(first), first)
    if "partition_count" not in section and ("fp32_flat_groups" in section or section.get("zero_stage") == 3):
        stage, world = 3, len(files)  # a ZeRO-3 state may omit it: one file per data-parallel rank
    else:
        stage, world = z.stage_and_world(section, first)
    missing = sorted(set(range(world)) - set(files))
    if missing:
        raise UniversalConversionError(f"{tag_dir}: written by {world} data-parallel ranks but the optimizer files "
                                       f"of ranks {missing} (mp_rank {mp_rank:02d}) are missing")
    paths = [files[r] for r in range(world)]
    return stage, world, [z.optimizer_section(z.load_checkpoint_file(p), p) for p in paths], paths


def _group_states(section: Mapping[str, Any], stage: int, path: str) -> tuple[list[torch.Tensor], dict[str, list]]:
    """One rank's fp32 partitions and {state key: per-group partitions}, plus per-group ``step`` values."""
    from ds_zero import zero_to_fp32 as z

    fp32 = z.fp32_groups(section, stage, path)
    base = section.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
    state = base.get("state") or {}
    out: dict[str, list] = {"exp_avg": [], "exp_avg_sq": [], "step": []}
    for g in range(len(fp32)):  # the state of group g is keyed by its index (or is entry g of a list)
        group = (state[g] if g < len(state) else {}) if isinstance(state, list) else state.get(g, {})
        for key in out:
            out[key].append(group.get(key))
    return fp32, out


def _lazy_states(stage: int, world: int, sections: Sequence[Mapping[str, Any]], paths: list[str],
                 shapes: list[Mapping[str, Any]], shapes_path: str) -> tuple[dict[str, dict], dict[int, Any]]:
    """{state key: {name: LazyTensor}} for fp32/exp_avg/exp_avg_sq, and {group: step} (from rank 0)."""
    from ds_zero import zero_to_fp32 as z

    per_rank = [_group_states(s, stage, p) for s, p in zip(sections, paths, strict=True)]
    lazy: dict[str, dict] = {}
    for key in STATE_KEYS:
        if key == "fp32":
            parts = [fp32 for fp32, _ in per_rank]
        else:
            parts = [states[key] for _, states in per_rank]
            if any(t is None for rank in parts for t in rank):
                continue  # not Adam-like (or never stepped): DeepSpeed's layout has no such files then
        lazy[key] = (z.trainable_stage3(shapes, parts, world) if stage == 3
                     else z.trainable_stage12(shapes, parts, world, shapes_path))
    steps = {g: s for g, s in enumerate(per_rank[0][1]["step"]) if s is not None}
    return lazy, steps


def _model_state_files(tag_dir: str, stage: int, mp_rank: int = 0) -> list[str]:
    from ds_zero import zero_to_fp32 as z

    files = _files_of_mp_rank(tag_dir, z.MODEL_STATES_RE, mp_rank)
    if stage == 3 and any(r is not None for r in files):
        return [files[r] for r in sorted(r for r in files if r is not None)]
    if None not in files:
        raise UniversalConversionError(f"{tag_dir}: no mp_rank_{mp_rank:02d}_model_states.pt file")
    return [files[None]]


def _check_required_state(model_state: Mapping[str, Any], inject: bool, path: str) -> None:
    info = model_state.get(UNIVERSAL_CHECKPOINT_INFO)
    if info is None and not inject:
        raise UniversalConversionError(
            f"Required {UNIVERSAL_CHECKPOINT_INFO} state is missing in checkpoint {path}. Verify that client creates "
            "this state, or pass --inject_missing_state (inject_missing_state=True)")


def _optimizer_common(section: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """DeepSpeed's ``zero/optimizer_state.pt``: the state without its partitioned tensors, plus ``param_groups``."""
    out = {k: v for k, v in section.items() if k not in (_SHARDED_3 if stage == 3 else _SHARDED_12)}
    base = section.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
    if stage == 3:  # DeepSpeed keeps the whole state here; the per-parameter files already hold the per-element
        # tensors, so only the per-group scalars (Adam's step) stay
        state = base.get("state") or {}
        items = state.items() if isinstance(state, Mapping) else enumerate(state)
        scalars = {g: {k: v for k, v in group.items() if not (isinstance(v, torch.Tensor) and v.numel() > 1)}
                   for g, group in items if isinstance(group, Mapping)}
        out["optimizer_state_dict"] = {"state": scalars, PARAM_GROUPS: base.get(PARAM_GROUPS, [])}
    out[PARAM_GROUPS] = base.get(PARAM_GROUPS, [])
    return out


def _model_states_name(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def _verify(zero_dir: str, shapes: list[Mapping[str, Any]], keys: list[str],
            expert_numels: Mapping[str, int] | None = None) -> None:
    """Every written ``zero/<name>/<key>.pt`` holds exactly the values its parameter has: ``param_shapes``, or
    for an AutoEP expert file (every expert-parallel rank's experts; ``param_shapes`` has one rank's) its
    ``expert_numels`` entry."""
    for group in shapes:
        for name, shape in group.items():
            for key in keys:
                path = os.path.join(zero_dir, name, f"{key}.pt")
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                tensor = obj[PARAM] if isinstance(obj, dict) else obj
                expert = isinstance(obj, dict) and bool(obj.get("is_expert_param"))
                if expert and name not in (expert_numels or {}):
                    raise UniversalConversionError(f"{path}: parameter {name!r} is written as an AutoEP expert "
                                                   "parameter but the conversion recorded no expert size for it")
                expected = expert_numels[name] if expert else math.prod(shape)
                if tensor.numel() != expected:
                    has = (f"expert parameter {name!r} needs {expected} (all its experts; {tuple(shape)} per rank)"
                           if expert else f"parameter {name!r} has shape {tuple(shape)}")
                    raise UniversalConversionError(f"{path}: {tensor.numel()} values, {has}")
