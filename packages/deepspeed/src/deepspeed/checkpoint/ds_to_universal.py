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
Pipeline-parallel checkpoints (ZeRO-1/2 with several stages: ``mp_rank_SS`` files whose model states hold
``pipeline_parts``) are converted stage by stage into one ``zero/`` folder by global parameter name (tied
parameters once), and the layer files are copied. AutoTP checkpoints (``tensor_parallel.autotp_size``, ZeRO
stage 0/1/2) are put back together from their tensor-parallel shards (``autotp_universal``). Tensor-parallel
checkpoints that describe their layout by ``universal_checkpoint_info`` merge rules (DeepSpeed's AutoTP under
ZeRO-3, and its ZeRO-1/2 ones) are merged by those rules (``tp_merge``). Before anything is written, a ZeRO-1/2
checkpoint is read as a ``DeepSpeedCheckpoint`` and refused when it lacks ``universal_checkpoint_info`` or marks
parameters unconvertible (``autotp_unsupported_parameter_patterns``), as DeepSpeed does. AutoEP checkpoints
(``ds_autoep_layers`` in the model states, ZeRO-1/2) put each expert weight's rows of every expert-parallel rank
together (``autoep_convert``), so the result loads at any ``autoep_size``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepspeed.checkpoint._conversion import (
    CAT_DIM,
    OPTIMIZER_STATE_FILE,
    PARAM,
    PARAM_GROUPS,
    UniversalConversionError,
    _check_required_state,
    _copy,
    _lazy_states,
    _model_state_files,
    _model_states_name,
    _mp_ranks,
    _optimizer_common,
    _progress,
    _rank_sections,
    _save,
    _verify,
)
from deepspeed.checkpoint._conversion import (  # the format's names stay importable from here, as in DeepSpeed
    STATE_KEYS as STATE_KEYS,
)
from deepspeed.checkpoint._conversion import (
    UNIVERSAL_CHECKPOINT_INFO as UNIVERSAL_CHECKPOINT_INFO,
)
from deepspeed.checkpoint._conversion import (
    UNIVERSAL_CHECKPOINT_VERSION_KEY as UNIVERSAL_CHECKPOINT_VERSION_KEY,
)
from deepspeed.checkpoint._conversion import (
    UNIVERSAL_CHECKPOINT_VERSION_VALUE as UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from deepspeed.checkpoint.autoep_convert import autoep_layers_of, convert_autoep_zero12
from deepspeed.checkpoint.autoep_metadata import (  # DeepSpeed's private name for it
    aggregate_autoep_zero12_metadata as _aggregate_autoep_zero12_metadata,  # noqa: F401
)
from deepspeed.checkpoint.autoep_zero3 import (  # DeepSpeed's private names for the ZeRO-3 AutoEP checks
    _autoep_expert_param_names_by_rank as _autoep_expert_param_names_by_rank,
)
from deepspeed.checkpoint.autoep_zero3 import _get_zero3_model_state_files as _get_zero3_model_state_files
from deepspeed.checkpoint.autoep_zero3 import (
    _uses_zero3_partitioned_autoep_metadata as _uses_zero3_partitioned_autoep_metadata,
)
from deepspeed.checkpoint.autoep_zero3 import expert_lazy_states, uses_partitioned_experts
from deepspeed.checkpoint.constants import AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS
from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from deepspeed.checkpoint.tp_merge import group_per_tp_shapes as _group_per_tp_shapes  # noqa: F401 - DeepSpeed names
from deepspeed.checkpoint.tp_merge import merge_tp_slices as merge_tp_slices
from deepspeed.checkpoint.tp_merge import read_tp_slices as _merge_zero_shards  # noqa: F401
from deepspeed.checkpoint.universal import LATEST_UNIVERSAL, ZERO_FOLDER
from deepspeed.runtime.checkpointing.atomic import atomic_write_text, make_dirs


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


def convert(input_folder: str, output_folder: str, inject_missing_state: bool = False, strict: bool = True) -> str:
    """Convert the tag folder ``input_folder``; returns ``output_folder``.

    A pipeline checkpoint (``mp_rank_SS`` files of several stages, each model-states file holding
    ``pipeline_parts``) is converted stage by stage into the one ``zero/`` folder: parameter names of a
    ``PipelineModule`` are global (layer index, ``tied_modules.<key>``), so the folders do not collide; a tied
    parameter, held by every stage that uses it with the same values, is written once (from the first stage).
    """
    input_folder, output_folder = os.fspath(input_folder), os.path.normpath(os.fspath(output_folder))
    if not os.path.isdir(input_folder):
        raise UniversalConversionError(f"input folder {input_folder!r} does not exist")
    if not _mp_ranks(input_folder) and _is_stage0_pipeline(input_folder):
        return _convert_stage0_pipeline(input_folder, output_folder, strict)
    if not _mp_ranks(input_folder) and _autotp_size(input_folder) > 1:  # AutoTP without ZeRO
        from deepspeed.checkpoint.autotp_universal import convert_autotp_stage0

        return convert_autotp_stage0(input_folder, output_folder, strict)
    mp_ranks = _mp_ranks(input_folder) or [0]
    if mp_ranks != list(range(len(mp_ranks))):
        raise UniversalConversionError(f"{input_folder}: optimizer files of model-parallel ranks {mp_ranks}; ranks "
                                       f"{sorted(set(range(max(mp_ranks) + 1)) - set(mp_ranks))} are missing")
    if mp_ranks == [0] and autoep_layers_of(input_folder) is not None:  # experts partitioned per expert rank
        return convert_autoep_zero12(input_folder, output_folder, inject_missing_state, strict)
    if len(mp_ranks) > 1 and _autotp_size(input_folder) > 1:  # tensor-parallel shards put back together
        from deepspeed.checkpoint.autotp_universal import convert_autotp

        return convert_autotp(input_folder, output_folder, mp_ranks, inject_missing_state, strict)
    rules = _tp_rules(input_folder, inject_missing_state) if len(mp_ranks) > 1 else None
    if rules is not None:  # tensor parallelism described by universal_checkpoint_info (DeepSpeed's AutoTP)
        from deepspeed.checkpoint.autotp_universal import convert_tp_by_rules

        return convert_tp_by_rules(input_folder, output_folder, mp_ranks, rules, strict)
    zero_dir = os.path.join(output_folder, ZERO_FOLDER)
    make_dirs(zero_dir)
    written: set[str] = set()
    expert_numels: dict[str, int] = {}
    all_shapes: list[Mapping[str, Any]] = []
    keys: list[str] = []
    common: dict[str, Any] | None = None
    model_files: list[str] = []
    for mp_rank in mp_ranks:
        stage_common, stage_files, shapes, stage_keys = _convert_mp_rank(
            input_folder, output_folder, zero_dir, mp_rank, len(mp_ranks), inject_missing_state, written,
            expert_numels)
        common = stage_common if common is None else common
        model_files += stage_files
        all_shapes += shapes
        keys = stage_keys if not keys else [k for k in keys if k in stage_keys]
    _save(os.path.join(zero_dir, OPTIMIZER_STATE_FILE), common)
    if len(mp_ranks) > 1:  # the pipeline's layer files (buffers, weights by global layer index) load from here too
        model_files += [os.path.join(input_folder, name) for name in sorted(os.listdir(input_folder))
                        if name.startswith("layer_") and name.endswith("model_states.pt")]
    for path in model_files:
        _copy(path, os.path.join(output_folder, os.path.basename(path)))
    if strict:
        _verify(zero_dir, all_shapes, keys, expert_numels)
    root, step_folder = os.path.split(output_folder)
    atomic_write_text(os.path.join(root or ".", LATEST_UNIVERSAL), step_folder)
    print("*** Done!")
    return output_folder


def _autotp_size(tag_dir: str) -> int:
    """``autotp_size`` of the checkpoint's first model-states file (1: not an AutoTP checkpoint)."""
    from deepspeed.checkpoint.autotp_universal import autotp_size_of
    from ds_zero import zero_to_fp32 as z

    path = os.path.join(tag_dir, _model_states_name(0))
    return autotp_size_of(z.load_checkpoint_file(path)) if os.path.isfile(path) else 1


def _tp_rules(tag_dir: str, inject_missing_state: bool) -> Mapping[str, Any] | None:
    """The ``universal_checkpoint_info`` by which the model-parallel ranks of ``tag_dir`` are tensor-parallel
    ones, or None when they are pipeline stages. A ZeRO-3 checkpoint's ranks are always TP ranks (an absent info:
    every slice concatenated along dim 0, as DeepSpeed); ZeRO-1/2 ones when the model states hold the info and no
    pipeline layout (``--inject_missing_state`` supplies the default info)."""
    from ds_zero import zero_to_fp32 as z

    stage = _rank_sections(tag_dir, 0)[0]
    path = _model_state_files(tag_dir, stage, 0)[0]
    state = z.load_checkpoint_file(path)
    info = state.get(UNIVERSAL_CHECKPOINT_INFO)
    if stage == 3:
        info = info or {}
    elif state.get("pipeline_parts") is not None:
        return None
    elif info is None and inject_missing_state:
        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    if info is not None:
        _validate_autotp_conversion_support(info)
    return info


def _convert_mp_rank(input_folder: str, output_folder: str, zero_dir: str, mp_rank: int, mp_world: int,
                     inject_missing_state: bool, written: set[str], expert_numels: dict[str, int]
                     ) -> tuple[dict[str, Any], list[str], list[Mapping[str, Any]], list[str]]:
    """Write the ``zero/<name>/`` folders of one model-parallel rank's parameters not in ``written`` (updated;
    ``expert_numels`` gets the exact size of each AutoEP expert file written).
    Returns (the optimizer's common state, the model-states files, ``param_shapes``, the state keys written)."""
    from ds_zero import zero_to_fp32 as z

    stage, world, sections, paths = _rank_sections(input_folder, mp_rank)
    model_files = _model_state_files(input_folder, stage, mp_rank)
    main_state = z.load_checkpoint_file(model_files[0])
    if mp_world > 1 and (stage == 3 or main_state.get("pipeline_parts") is None):
        raise UniversalConversionError(f"{input_folder}: a checkpoint of {mp_world} model-parallel ranks; only "
                                       "pipeline-parallel ones (ZeRO stage 0/1/2, files holding pipeline_parts) "
                                       "and AutoTP ones (tensor_parallel.autotp_size, ZeRO stage 0/1/2) can be "
                                       "converted, not other tensor-parallel layouts")
    if stage <= 2:
        _check_required_state(main_state, inject_missing_state, model_files[0])
    shapes = z.read_param_shapes(main_state, model_files[0])
    experts: dict[str, int] = {}
    if stage == 3 and uses_partitioned_experts(sections):  # AutoEP experts: partitions per expert group
        lazy, steps, experts = expert_lazy_states(sections, paths, model_files, shapes)
        expert_numels.update(experts)
    else:
        lazy, steps = _lazy_states(stage, world, sections, paths, shapes, model_files[0])
    names = [name for group in shapes for name in group if name not in written]
    group_of = {name: g for g, group in enumerate(shapes) for name in group}
    where = f" (pipeline stage {mp_rank} of {mp_world})" if mp_world > 1 else ""
    print(f"Converting ZeRO stage {stage} checkpoint {input_folder}{where} ({world} ranks) to {output_folder}")
    for name in _progress(names, "ds_to_universal"):
        param_dir = os.path.join(zero_dir, name)
        make_dirs(param_dir)
        for key, tensors in lazy.items():
            value = tensors[name].contiguous()  # one parameter's state in memory at a time
            obj = value.reshape(-1) if stage == 3 else {PARAM: value, CAT_DIM: 0}
            if name in experts:  # every expert's rows: a universal load takes its own expert-parallel rank's
                obj = {PARAM: value, CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: int(value.shape[0])}
            _save(os.path.join(param_dir, f"{key}.pt"), obj)
            del value, obj
        if group_of[name] in steps:  # DeepSpeed writes it at stage 1/2; stage 3 gets it too (loaders ignore it)
            _save(os.path.join(param_dir, "step.pt"), steps[group_of[name]])
        written.add(name)
    if stage <= 2:  # parameters without optimizer state (frozen) and buffers: their model values, as DeepSpeed
        for name, tensor in (main_state.get("module") or {}).items():
            if isinstance(tensor, torch.Tensor) and name not in group_of and name not in written and tensor.numel():
                make_dirs(os.path.join(zero_dir, name))
                _save(os.path.join(zero_dir, name, "fp32.pt"), {PARAM: tensor.detach().float().clone()})
                written.add(name)
    return _optimizer_common(sections[0], stage), model_files, shapes, list(lazy)


def _is_stage0_pipeline(tag_dir: str) -> bool:
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        return False
    from ds_zero import zero_to_fp32 as z

    state = z.load_checkpoint_file(path)
    return state.get("pipeline_parts") is not None and state.get("pipeline_param_names") is not None


def _layer_value(tag_dir: str, name: str, names: Sequence[str], span: range, cache: dict[int, Any]) -> torch.Tensor:
    """A parameter's weight from the stage's layer files: ``L.rest`` is key ``rest`` of ``layer_L``; a tied
    ``tied_modules.<key>.rest`` is key ``rest`` of the stage's first layer file whose own names are not trained
    under its index (the tied module's layer)."""
    from ds_zero import zero_to_fp32 as z

    def layer(index: int) -> Any:
        if index not in cache:
            path = os.path.join(tag_dir, f"layer_{index:02d}-model_states.pt")
            cache[index] = z.load_checkpoint_file(path) if os.path.isfile(path) else {}
        return cache[index]

    head, _, rest = name.partition(".")
    if head.isdigit() and rest in layer(int(head)):
        return layer(int(head))[rest]
    if head == "tied_modules":
        rest = rest.partition(".")[2]
        for index in span:
            if not any(n.startswith(f"{index}.") for n in names) and rest in layer(index):
                return layer(index)[rest]
    raise UniversalConversionError(f"{tag_dir}: no layer file holds the weights of parameter {name!r}")


def _convert_stage0_pipeline(input_folder: str, output_folder: str, strict: bool) -> str:
    """A pipeline checkpoint without ZeRO: each stage's ``mp_rank_SS`` file holds its whole optimizer state with
    the global names of its parameters (``pipeline_param_names``); the fp32 values are the master weights when
    saved, else the layer files' weights."""
    from ds_zero import zero_to_fp32 as z

    zero_dir = os.path.join(output_folder, ZERO_FOLDER)
    make_dirs(zero_dir)
    files = sorted(name for name in os.listdir(input_folder) if name.endswith("model_states.pt")
                   and (name.startswith("layer_") or z.MODEL_STATES_RE.match(name)))
    first = z.load_checkpoint_file(os.path.join(input_folder, "mp_rank_00_model_states.pt"))
    parts, written, shapes, common = list(first["pipeline_parts"]), set(), {}, None
    print(f"Converting pipeline checkpoint {input_folder} ({len(parts) - 1} stages, no ZeRO) to {output_folder}")
    for stage in range(len(parts) - 1):
        path = os.path.join(input_folder, _model_states_name(stage))
        state = first if stage == 0 else z.load_checkpoint_file(path)
        names, optimizer = state.get("pipeline_param_names"), state.get("optimizer")
        if names is None or optimizer is None:
            raise UniversalConversionError(f"{path}: no optimizer state by parameter name (saved without an "
                                           "optimizer?); nothing to convert")
        # the wrapped optimizer's state dict, plain (fp32, as DeepSpeed) or under 'optimizer_state_dict' (scaled, bf16)
        inner = optimizer.get("optimizer_state_dict", optimizer)
        masters = optimizer.get("fp32_master_weights")
        common = common if common is not None else {PARAM_GROUPS: inner.get(PARAM_GROUPS, []),
                                                    "loss_scaler": optimizer.get("loss_scaler")}
        cache: dict[int, Any] = {}
        for index, name in enumerate(names):
            if name in written:
                continue
            param_dir = os.path.join(zero_dir, name)
            make_dirs(param_dir)
            value = (masters[index] if masters is not None
                     else _layer_value(input_folder, name, names, range(parts[stage], parts[stage + 1]), cache))
            shapes[name] = tuple(value.shape)
            _save(os.path.join(param_dir, "fp32.pt"), {PARAM: value.detach().float().clone(), CAT_DIM: 0})
            entry = inner["state"].get(index, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if isinstance(entry.get(key), torch.Tensor):
                    _save(os.path.join(param_dir, f"{key}.pt"), {PARAM: entry[key].detach().float().clone(),
                                                                CAT_DIM: 0})
            if "step" in entry:
                _save(os.path.join(param_dir, "step.pt"), entry["step"])
            written.add(name)
    _save(os.path.join(zero_dir, OPTIMIZER_STATE_FILE), common)
    for name in files:
        _copy(os.path.join(input_folder, name), os.path.join(output_folder, name))
    if strict:
        _verify(zero_dir, [shapes], ["fp32"])
    root, step_folder = os.path.split(output_folder)
    atomic_write_text(os.path.join(root or ".", LATEST_UNIVERSAL), step_folder)
    print("*** Done!")
    return output_folder


def _get_optim_files(checkpoint_dir: str) -> list[str]:
    """The tag folder's ``*_optim_states.pt`` files in natural order ([] without ZeRO)."""
    from ds_zero import zero_to_fp32 as z

    return z.get_optim_files(checkpoint_dir) if os.path.isdir(checkpoint_dir) and any(
        name.endswith("_optim_states.pt") for name in os.listdir(checkpoint_dir)) else []


def _filter_zero3_optim_files(optim_files: Sequence[str]) -> list[str]:
    """The ZeRO rank files among ``optim_files`` (``[bf16_]zero_pp_rank_*``; not the MoE expert files)."""
    return [f for f in optim_files if os.path.basename(f).startswith(("zero_pp_rank_", "bf16_zero_pp_rank_"))]


def _get_zero_stage(optim_files: Sequence[str]) -> int:
    """The ZeRO stage the first of ``optim_files`` records (1 when it records none: the bf16 optimizer's)."""
    from ds_zero import zero_to_fp32 as z

    section = z.optimizer_section(z.load_checkpoint_file(optim_files[0]), optim_files[0])
    return int(section.get("zero_stage", 1))


def _inject_missing_state(ds_checkpoint: Any) -> None:
    """Give a checkpoint read without ``universal_checkpoint_info`` the default one (no merge patterns)."""
    if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def _check_for_required_state(ds_checkpoint: Any, exact_layouts: bool = False) -> None:
    """The checkpoint holds ``universal_checkpoint_info`` and (unless ``exact_layouts``: our AutoTP checkpoints,
    merged by their recorded ``autotp_layouts`` rather than by these rules) marks no parameter unconvertible."""
    info = ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    if info is None:
        raise UniversalConversionError(
            f"Required {UNIVERSAL_CHECKPOINT_INFO} state is missing in checkpoint {ds_checkpoint.dir}. Verify that "
            "client creates this state, or pass --inject_missing_state (inject_missing_state=True)")
    if not exact_layouts:
        _validate_autotp_conversion_support(info)


def _validate_autotp_conversion_support(universal_checkpoint_info: Mapping[str, Any]) -> None:
    """Refuse parameters the model marked as laid out in a way the merge rules cannot describe (e.g. an
    interleaved fused QKV): converting them would write wrong full tensors."""
    unsupported = universal_checkpoint_info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = ", ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise UniversalConversionError(f"AutoTP universal checkpoint conversion is not supported for {details}")


def _preflight(args: argparse.Namespace) -> None:
    """DeepSpeed's checks before any file is written: a ZeRO-1/2 checkpoint holds ``universal_checkpoint_info``
    (or ``--inject_missing_state``), and no parameter is marked unconvertible."""
    optim_files = _get_optim_files(args.input_folder)
    if not optim_files:  # without ZeRO: convert() reads the model states itself
        return
    if _get_zero_stage(_filter_zero3_optim_files(optim_files) or optim_files) <= 2:
        ds_checkpoint = DeepSpeedCheckpoint(args.input_folder)
        if getattr(args, "inject_missing_state", False):
            _inject_missing_state(ds_checkpoint)
        _check_for_required_state(ds_checkpoint, exact_layouts=_autotp_size(args.input_folder) > 1)


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Console entry (``ds_to_universal``) and DeepSpeed's ``main(args)``."""
    if args is None or isinstance(args, (list, tuple)):
        args = parse_arguments(args)
    print("Convert DeepSpeed Checkpoint to Universal Checkpoint")
    _preflight(args)
    convert(args.input_folder, args.output_folder, inject_missing_state=getattr(args, "inject_missing_state", False),
            strict=getattr(args, "strict", True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
