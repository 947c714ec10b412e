"""``ds_to_universal``: convert a ZeRO stage 1/2/3 checkpoint tag folder into DeepSpeed's Universal Checkpoint.

Usage (DeepSpeed's arguments)::

    ds_to_universal --input_folder ckpt/global_step2 --output_folder ckpt/global_step2_universal \
        [--inject_missing_state] [--no_strict] [--keep_temp_folder] [--num_extract_workers N] [--num_merge_workers N]

or in-process ``deepspeed.checkpoint.ds_to_universal.main(args)`` (``args``: an ``argparse.Namespace`` from
:func:`parse_arguments`, or an argv list).

Output (DeepSpeed's layout): ``<output>/zero/<param name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (stage 1/2:
``{"param": tensor of the parameter's shape, "cat_dim": 0}`` plus ``step.pt`` when the optimizer counts steps;
stage 3: the flat tensor, as DeepSpeed writes it), ``<output>/zero/optimizer_state.pt`` (the optimizer's
un-partitioned state: loss scaler, ``param_groups``, ...), the model-states file(s) copied, and
``<parent of output>/latest_universal`` holding the output folder's name.

Differences from DeepSpeed, by design: no temporary fragment folder (each parameter is read straight from the
memory-mapped rank files and written once, one parameter in memory at a time), so ``--keep_temp_folder`` and
the worker counts are accepted and ignored; every file is written atomically. Stage 1/2 checkpoints must hold
``universal_checkpoint_info`` in the model-states file (``--inject_missing_state`` adds the default one), as in
DeepSpeed. ``strict`` (default; ``--no_strict`` turns it off) checks every converted parameter's files at the end.
Tensor/pipeline-parallel checkpoints (mp_rank > 0) are not supported.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from deepspeed.checkpoint.universal import LATEST_UNIVERSAL, ZERO_FOLDER
from deepspeed.runtime.checkpointing._atomic import atomic_write, atomic_write_text, make_dirs

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds_to_universal",
                                     description="Convert a DeepSpeed ZeRO checkpoint to a Universal Checkpoint")
    parser.add_argument("--input_folder", type=str, required=True, help="Input DeepSpeed Checkpoint folder")
    parser.add_argument("--output_folder", type=str, required=True, help="Output DeepSpeed checkpoint folder")
    parser.add_argument("--num_extract_workers", default=4, type=int,
                        help="How many parallel processes to extract zero shards (accepted; conversion streams)")
    parser.add_argument("--num_merge_workers", default=2, type=int,
                        help="How many parallel processes to merge tp slices (accepted; conversion streams)")
    parser.add_argument("--keep_temp_folder", action="store_true",
                        help="Preserve temporary folder of intermediate checkpoint slice files (none is made here)")
    parser.add_argument("--no_strict", dest="strict", action="store_false",
                        help="Do not perform validity checks on converted checkpoint.")
    parser.add_argument("--inject_missing_state", action="store_true",
                        help="Inject missing checkpoint state into the checkpoint if it is absent.")
    return parser


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


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


def _rank_sections(tag_dir: str) -> tuple[int, int, list[Mapping[str, Any]], list[str]]:
    """(stage, world, every rank's memory-mapped ``optimizer_state_dict``, the files)."""
    from ds_zero import zero_to_fp32 as z

    files = z._rank_files(tag_dir, z._OPTIM_STATES_RE)
    if not files:
        raise UniversalConversionError(f"{tag_dir}: no zero_pp_rank_<r>_mp_rank_00_optim_states.pt files; only ZeRO "
                                       "stage 1/2/3 checkpoint tag folders can be converted")
    first = files[min(files)]
    stage, world = z._stage_and_world(z._optimizer_section(z._load(first), first), first)
    missing = sorted(set(range(world)) - set(files))
    if missing:
        raise UniversalConversionError(f"{tag_dir}: written by {world} data-parallel ranks but the optimizer files "
                                       f"of ranks {missing} are missing")
    paths = [files[r] for r in range(world)]
    return stage, world, [z._optimizer_section(z._load(p), p) for p in paths], paths


def _group_states(section: Mapping[str, Any], stage: int, path: str) -> tuple[list[torch.Tensor], dict[str, list]]:
    """One rank's fp32 partitions and {state key: per-group partitions}, plus per-group ``step`` values."""
    from ds_zero import zero_to_fp32 as z

    fp32 = z._fp32_groups(section, stage, path)
    base = section.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}
    state = base.get("state") or {}
    out: dict[str, list] = {"exp_avg": [], "exp_avg_sq": [], "step": []}
    for g in range(len(fp32)):
        group = state.get(g, {})
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
        lazy[key] = (z._trainable_stage3(shapes, parts, world) if stage == 3
                     else z._trainable_stage12(shapes, parts, world, shapes_path))
    steps = {g: s for g, s in enumerate(per_rank[0][1]["step"]) if s is not None}
    return lazy, steps


def _model_state_files(tag_dir: str, stage: int) -> list[str]:
    from ds_zero import zero_to_fp32 as z

    files = z._rank_files(tag_dir, z._MODEL_STATES_RE)
    if stage == 3 and any(r is not None for r in files):
        return [files[r] for r in sorted(r for r in files if r is not None)]
    if None not in files:
        raise UniversalConversionError(f"{tag_dir}: no mp_rank_00_model_states.pt file")
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
    if stage == 3:  # DeepSpeed keeps the whole state here; the per-parameter files already hold it
        out["optimizer_state_dict"] = {PARAM_GROUPS: base.get(PARAM_GROUPS, [])}
    out[PARAM_GROUPS] = base.get(PARAM_GROUPS, [])
    return out


def convert(input_folder: str, output_folder: str, inject_missing_state: bool = False, strict: bool = True) -> str:
    """Convert the tag folder ``input_folder``; returns ``output_folder``."""
    from ds_zero import zero_to_fp32 as z

    input_folder, output_folder = os.fspath(input_folder), os.path.normpath(os.fspath(output_folder))
    if not os.path.isdir(input_folder):
        raise UniversalConversionError(f"input folder {input_folder!r} does not exist")
    stage, world, sections, paths = _rank_sections(input_folder)
    model_files = _model_state_files(input_folder, stage)
    main_state = z._load(model_files[0])
    if stage <= 2:
        _check_required_state(main_state, inject_missing_state, model_files[0])
    shapes = z._param_groups(main_state, model_files[0])
    lazy, steps = _lazy_states(stage, world, sections, paths, shapes, model_files[0])
    zero_dir = os.path.join(output_folder, ZERO_FOLDER)
    make_dirs(zero_dir)
    names = [name for group in shapes for name in group]
    group_of = {name: g for g, group in enumerate(shapes) for name in group}
    print(f"Converting ZeRO stage {stage} checkpoint {input_folder} ({world} ranks) to {output_folder}")
    for name in _progress(names, "ds_to_universal"):
        param_dir = os.path.join(zero_dir, name)
        make_dirs(param_dir)
        for key, tensors in lazy.items():
            value = tensors[name].contiguous()  # one parameter's state in memory at a time
            obj = value.reshape(-1) if stage == 3 else {PARAM: value, CAT_DIM: 0}
            _save(os.path.join(param_dir, f"{key}.pt"), obj)
            del value, obj
        if group_of[name] in steps:  # DeepSpeed writes it at stage 1/2; stage 3 gets it too (loaders ignore it)
            _save(os.path.join(param_dir, "step.pt"), steps[group_of[name]])
    if stage <= 2:  # parameters without optimizer state (frozen) and buffers: their model values, as DeepSpeed
        for name, tensor in (main_state.get("module") or {}).items():
            if isinstance(tensor, torch.Tensor) and name not in group_of and tensor.numel() > 0:
                make_dirs(os.path.join(zero_dir, name))
                _save(os.path.join(zero_dir, name, "fp32.pt"), {PARAM: tensor.detach().float().clone()})
    _save(os.path.join(zero_dir, OPTIMIZER_STATE_FILE), _optimizer_common(sections[0], stage))
    for path in model_files:
        _copy(path, os.path.join(output_folder, os.path.basename(path)))
    if strict:
        _verify(zero_dir, shapes, list(lazy))
    root, step_folder = os.path.split(output_folder)
    atomic_write_text(os.path.join(root or ".", LATEST_UNIVERSAL), step_folder)
    print("*** Done!")
    return output_folder


def _verify(zero_dir: str, shapes: list[Mapping[str, Any]], keys: list[str]) -> None:
    for group in shapes:
        for name, shape in group.items():
            for key in keys:
                path = os.path.join(zero_dir, name, f"{key}.pt")
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                tensor = obj[PARAM] if isinstance(obj, dict) else obj
                if tensor.numel() != math.prod(shape):
                    raise UniversalConversionError(f"{path}: {tensor.numel()} values, parameter {name!r} has shape "
                                                   f"{tuple(shape)}")


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Console entry (``ds_to_universal``) and DeepSpeed's ``main(args)``."""
    if args is None or isinstance(args, (list, tuple)):
        args = parse_arguments(args)
    print("Convert DeepSpeed Checkpoint to Universal Checkpoint")
    convert(args.input_folder, args.output_folder, inject_missing_state=getattr(args, "inject_missing_state", False),
            strict=getattr(args, "strict", True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
