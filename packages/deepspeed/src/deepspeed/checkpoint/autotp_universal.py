"""``ds_to_universal`` for AutoTP training checkpoints (``tensor_parallel.autotp_size`` > 1, ZeRO stage 1/2).

Each tensor-parallel rank ``t`` wrote ``zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt`` (the ZeRO partitions of
its shards: fp32 values and Adam moments) and ``mp_rank_<t>_model_states.pt`` (full weights, the shard shapes in
``param_shapes`` and, under ``autotp_layouts``, how every sharded parameter was cut). A parameter's full fp32
value and each moment are put back together from the ranks' shards with that layout: rank ``t``'s shard is the
concatenation, along the split dimension, of its ``(start, length)`` pieces of the full dimension (one piece per
fused sub-parameter, e.g. Q, K and V), so the pieces go back to those ranges. Replicated parameters (norms,
biases of row-parallel layers) are the same on every rank and are taken from rank 0. The output is the ordinary
universal layout (``zero/<name>/fp32.pt`` of the full shape), which loads at any ``autotp_size`` (each rank cuts
its shard at load) or without tensor parallelism.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

AUTOTP_SIZE = "autotp_size"
AUTOTP_LAYOUTS = "autotp_layouts"
ZERO = "zero"  # the universal folder of per-parameter files


def autotp_size_of(model_state: Mapping[str, Any]) -> int:
    """The AutoTP size a model-states file was written with (1: none)."""
    return int(model_state.get(AUTOTP_SIZE) or 1)


def assemble(shards: Sequence[torch.Tensor], layout: Mapping[str, Any] | None) -> torch.Tensor:
    """The full tensor from the tensor-parallel ranks' ``shards`` (``layout`` None: replicated, rank 0's)."""
    if layout is None:
        return shards[0].detach().float().clone()
    dim, pieces = int(layout["dim"]), layout["pieces"]
    if len(pieces) != len(shards):
        raise ValueError(f"the layout cuts {len(pieces)} shards, the checkpoint has {len(shards)}")
    shape = list(shards[0].shape)
    shape[dim] = int(layout["full"])
    full = torch.empty(shape, dtype=torch.float32)
    for shard, ranges in zip(shards, pieces, strict=True):
        cursor = 0
        for start, length in ranges:
            full.narrow(dim, int(start), int(length)).copy_(shard.narrow(dim, cursor, int(length)))
            cursor += int(length)
        if cursor != shard.shape[dim]:
            raise ValueError(f"a shard of {shard.shape[dim]} entries along dim {dim}, its layout covers {cursor}")
    return full


def _rank_widths(layout: Mapping[str, Any]) -> list[list[int]] | None:
    """``widths[i][r]``: rank ``r``'s length of sub-parameter ``i`` when every rank holds one piece of each
    sub-parameter and the pieces tile each sub-parameter in rank order (what DeepSpeed's rules can describe);
    None otherwise."""
    pieces = layout["pieces"]
    count = len(pieces[0])
    if any(len(rank) != count for rank in pieces):
        return None
    widths, cursor = [], 0
    for i in range(count):
        widths.append([int(rank[i][1]) for rank in pieces])
        for rank in pieces:
            if int(rank[i][0]) != cursor and int(rank[i][1]):
                return None
            cursor += int(rank[i][1])
    return widths if cursor == int(layout["full"]) else None


def universal_checkpoint_info(layouts: Mapping[str, Mapping[str, Any]],
                              shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """DeepSpeed's ``universal_checkpoint_info`` merge rules for an AutoTP model, from its ``autotp_layouts`` and
    the shapes of all its trained parameters (``shapes``: name -> this rank's shape), so DeepSpeed's converter
    (and ours, for checkpoints without layouts) merges its slices: one TP-replicated pattern per unsharded
    parameter, a row-parallel one per parameter split along dim 1, fused ones (QKV, gate/up) as sub-parameters
    with each rank's widths; a layout the rules cannot express is listed as unsupported, never merged wrongly."""
    from deepspeed.checkpoint import constants as c

    info: dict[str, Any] = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                            c.TP_REPLICATED_PARAMETER_PATTERNS: [], c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
                            c.PARAMETER_WITH_SUB_PARAMS: [], c.SUB_PARAM_SHARD_WIDTHS: {}}
    unsupported: dict[str, str] = {}
    for name, shape in shapes.items():
        pattern = f"^{re.escape(name)}$"
        layout = layouts.get(name)
        if layout is None:
            info[c.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
            continue
        dim, widths = int(layout["dim"]), _rank_widths(layout)
        if widths is None or dim > 1:
            unsupported[pattern] = (f"{name} is split along dim {dim} in pieces {layout['pieces']} that DeepSpeed's "
                                    "merge rules cannot describe")
        elif len(widths) > 1:
            spec: list[Any] = [-1] * len(shape)
            spec[dim] = tuple(sum(w) for w in widths)
            if len(shape) > 2:  # one placeholder at most: the other dimensions are the shard's own
                spec = [d if i == dim else int(shape[i]) for i, d in enumerate(spec)]
            info[c.PARAMETER_WITH_SUB_PARAMS].append({"patterns": [pattern], "shape": spec, "partition_dim": dim})
            info[c.SUB_PARAM_SHARD_WIDTHS][pattern] = widths
        elif dim == 1:
            info[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
    if unsupported:
        info[c.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS] = unsupported
    return info


def convert_autotp(input_folder: str, output_folder: str, mp_ranks: list[int], inject_missing_state: bool,
                   strict: bool) -> str:
    """Convert an AutoTP ZeRO-1/2 tag folder written by ``len(mp_ranks)`` tensor-parallel ranks."""
    from deepspeed.checkpoint import _conversion as du
    from deepspeed.checkpoint.universal import ZERO_FOLDER
    from deepspeed.runtime.checkpointing.atomic import make_dirs
    from ds_zero import zero_to_fp32 as z

    per_rank, model_files = [], []
    for mp_rank in mp_ranks:
        stage, world, sections, paths = du._rank_sections(input_folder, mp_rank)
        files = du._model_state_files(input_folder, stage, mp_rank)
        state = z.load_checkpoint_file(files[0])
        du._check_required_state(state, inject_missing_state, files[0])
        shapes = z.read_param_shapes(state, files[0])
        lazy, steps = du._lazy_states(stage, world, sections, paths, shapes, files[0])
        per_rank.append((state, shapes, lazy, steps, sections[0]))
        model_files += files
    main, shapes, lazy0, steps, section = per_rank[0]
    layouts = main.get(AUTOTP_LAYOUTS)
    if layouts is None:
        raise du.UniversalConversionError(
            f"{input_folder}: an AutoTP checkpoint (autotp_size={autotp_size_of(main)}) without '{AUTOTP_LAYOUTS}' "
            "in its model states (saved by an older version), so the shards cannot be put back together; load it at "
            "its own autotp_size and save it again")
    names = [name for group in shapes for name in group]
    for mp_rank, (_, other, _, _, _) in zip(mp_ranks, per_rank, strict=True):
        if [n for g in other for n in g] != names:
            raise du.UniversalConversionError(f"{input_folder}: tensor-parallel rank {mp_rank} trained other "
                                              "parameters than rank 0; not one AutoTP model")
    zero_dir = os.path.join(output_folder, ZERO_FOLDER)
    make_dirs(zero_dir)
    group_of = {name: g for g, group in enumerate(shapes) for name in group}
    module = main.get("module") or {}
    print(f"Converting AutoTP (tp={len(mp_ranks)}) ZeRO stage {stage} checkpoint {input_folder} to {output_folder}")
    for name in du._progress(names, "ds_to_universal"):
        param_dir = os.path.join(zero_dir, name)
        make_dirs(param_dir)
        for key in lazy0:
            full = assemble([rank[2][key][name].contiguous() for rank in per_rank], layouts.get(name))
            du._save(os.path.join(param_dir, f"{key}.pt"), {du.PARAM: full, du.CAT_DIM: 0})
            del full
        if group_of[name] in steps:
            du._save(os.path.join(param_dir, "step.pt"), steps[group_of[name]])
    for name, tensor in module.items():  # frozen parameters and buffers: the full weights of the model states
        if isinstance(tensor, torch.Tensor) and name not in group_of and tensor.numel():
            make_dirs(os.path.join(zero_dir, name))
            du._save(os.path.join(zero_dir, name, "fp32.pt"), {du.PARAM: tensor.detach().float().clone()})
    du._save(os.path.join(zero_dir, du.OPTIMIZER_STATE_FILE), du._optimizer_common(section, stage))
    full_shapes = {name: tuple(module[name].shape) if name in module else tuple(shape)
                   for group in shapes for name, shape in group.items()}
    return _finish(output_folder, model_files, full_shapes if strict else None, list(lazy0))


AUTOTP_PARAM_NAMES = "autotp_param_names"  # ZeRO-0: the optimizer's parameters by name, in its state order


def _tp_model_states(input_folder: str) -> list[tuple[str, dict[str, Any]]]:
    """``(path, model states)`` of every tensor-parallel rank, ``mp_rank_00`` first."""
    from deepspeed.checkpoint import _conversion as du
    from ds_zero import zero_to_fp32 as z

    out, rank = [], 0
    while os.path.isfile(path := os.path.join(input_folder, du._model_states_name(rank))):
        out.append((path, z.load_checkpoint_file(path)))
        rank += 1
    size = autotp_size_of(out[0][1])
    if len(out) != size:
        raise du.UniversalConversionError(f"{input_folder}: an AutoTP checkpoint of autotp_size={size} holds "
                                          f"{len(out)} mp_rank_XX_model_states.pt files")
    return out


def convert_autotp_stage0(input_folder: str, output_folder: str, strict: bool) -> str:
    """Convert an AutoTP checkpoint without ZeRO: each rank's model states hold its whole optimizer state (the
    moments of its shards, by index in ``autotp_param_names`` order); the fp32 values are the full weights of
    the model states (the master weights themselves when training in fp32)."""
    from deepspeed.checkpoint import _conversion as du
    from deepspeed.checkpoint.universal import ZERO_FOLDER
    from deepspeed.runtime.checkpointing.atomic import make_dirs

    ranks = _tp_model_states(input_folder)
    main = ranks[0][1]
    names, layouts, optimizer = main.get(AUTOTP_PARAM_NAMES), main.get(AUTOTP_LAYOUTS), main.get("optimizer")
    if names is None or layouts is None or optimizer is None:
        raise du.UniversalConversionError(
            f"{ranks[0][0]}: an AutoTP checkpoint without ZeRO needs '{AUTOTP_PARAM_NAMES}', '{AUTOTP_LAYOUTS}' and "
            "'optimizer' in its model states (saved by an older version, or without an optimizer); load it at its "
            "own autotp_size and save it again")
    # the wrapped optimizer's state dict, plain (fp32, as DeepSpeed) or under 'optimizer_state_dict' (scaled, bf16)
    states = [r[1]["optimizer"].get("optimizer_state_dict", r[1]["optimizer"])["state"] for r in ranks]
    module, zero_dir = main.get("module") or {}, os.path.join(output_folder, ZERO_FOLDER)
    make_dirs(zero_dir)
    print(f"Converting AutoTP (tp={len(ranks)}) checkpoint without ZeRO {input_folder} to {output_folder}")
    keys: list[str] = ["fp32"]
    for index, name in enumerate(names):
        param_dir = os.path.join(zero_dir, name)
        make_dirs(param_dir)
        du._save(os.path.join(param_dir, "fp32.pt"), {du.PARAM: module[name].detach().float().clone(), du.CAT_DIM: 0})
        entry = states[0].get(index, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(entry.get(key), torch.Tensor):
                full = assemble([state[index][key] for state in states], layouts.get(name))
                du._save(os.path.join(param_dir, f"{key}.pt"), {du.PARAM: full, du.CAT_DIM: 0})
                keys = keys if key in keys else [*keys, key]
        if "step" in entry:
            du._save(os.path.join(param_dir, "step.pt"), entry["step"])
    inner = main["optimizer"].get("optimizer_state_dict", main["optimizer"])
    du._save(os.path.join(zero_dir, du.OPTIMIZER_STATE_FILE),
             {du.PARAM_GROUPS: inner.get(du.PARAM_GROUPS, []), "loss_scaler": main["optimizer"].get("loss_scaler")})
    shapes = {name: tuple(module[name].shape) for name in names}
    return _finish(output_folder, [path for path, _ in ranks], shapes if strict else None, keys)


def convert_tp_by_rules(input_folder: str, output_folder: str, mp_ranks: list[int], uc_info: Mapping[str, Any],
                        strict: bool) -> str:
    """Convert a tensor-parallel checkpoint that describes its layout by ``universal_checkpoint_info`` rules
    (DeepSpeed's AutoTP: ZeRO-3, where every ``zero_pp_rank_<dp>_mp_rank_<tp>`` file pair holds one data-parallel
    partition of one TP rank's shards, or ZeRO-1/2 files written by DeepSpeed). Each model-parallel rank is one
    TP rank; its values and moments are first joined across data-parallel ranks at its own shard shapes, then the
    TP slices are merged by :class:`~deepspeed.checkpoint.tp_merge.MergeRules`, one parameter at a time."""
    from deepspeed.checkpoint import _conversion as du
    from deepspeed.checkpoint.tp_merge import MergeRules
    from deepspeed.checkpoint.universal import ZERO_FOLDER
    from deepspeed.runtime.checkpointing.atomic import make_dirs
    from ds_zero import zero_to_fp32 as z

    per_rank, model_files = [], []
    for mp_rank in mp_ranks:
        stage, world, sections, paths = du._rank_sections(input_folder, mp_rank)
        files = du._model_state_files(input_folder, stage, mp_rank)
        shapes = z.read_param_shapes(z.load_checkpoint_file(files[0]), files[0])
        lazy, steps = du._lazy_states(stage, world, sections, paths, shapes, files[0])
        per_rank.append((shapes, lazy, steps, sections[0], stage))
        model_files += files
    shapes, lazy0, steps, section, stage = per_rank[0]
    names = [name for group in shapes for name in group]
    for mp_rank, rank in zip(mp_ranks, per_rank, strict=True):
        if [n for g in rank[0] for n in g] != names:
            raise du.UniversalConversionError(f"{input_folder}: tensor-parallel rank {mp_rank} trained other "
                                              "parameters than rank 0; not one tensor-parallel model")
    zero_dir, rules = os.path.join(output_folder, ZERO_FOLDER), MergeRules(uc_info)
    make_dirs(zero_dir)
    group_of = {name: g for g, group in enumerate(shapes) for name in group}
    full_shapes: dict[str, tuple] = {}
    print(f"Converting tensor-parallel (tp={len(mp_ranks)}) ZeRO stage {stage} checkpoint {input_folder} to "
          f"{output_folder}")
    for name in du._progress(names, "ds_to_universal"):
        param_dir = os.path.join(zero_dir, name)
        make_dirs(param_dir)
        for key in lazy0:
            merged = rules.merge(name, [rank[1][key][name].contiguous() for rank in per_rank])
            full_shapes[name] = tuple(merged[du.PARAM].shape)
            du._save(os.path.join(param_dir, f"{key}.pt"), merged)
            del merged
        if group_of[name] in steps:
            du._save(os.path.join(param_dir, "step.pt"), steps[group_of[name]])
    if rules.unmatched:
        if strict:
            raise du.UniversalConversionError(f"{input_folder}: universal_checkpoint_info patterns "
                                              f"{sorted(rules.unmatched)} match no parameter (pass --no_strict to "
                                              "convert anyway)")
        print(f"Warning: Unused patterns={sorted(rules.unmatched)} while merging tp slices")
    du._save(os.path.join(zero_dir, du.OPTIMIZER_STATE_FILE), du._optimizer_common(section, stage))
    return _finish(output_folder, model_files, full_shapes if strict else None, list(lazy0))


def _finish(output_folder: str, model_files: list[str], shapes: dict[str, tuple] | None, keys: list[str]) -> str:
    """Copy the model-states files, check every written file against the full ``shapes`` (None: no check) and
    point ``latest_universal`` at the output folder."""
    from deepspeed.checkpoint import _conversion as du
    from deepspeed.checkpoint.universal import LATEST_UNIVERSAL, ZERO_FOLDER
    from deepspeed.runtime.checkpointing.atomic import atomic_write_text

    for path in model_files:
        du._copy(path, os.path.join(output_folder, os.path.basename(path)))
    if shapes is not None:
        du._verify(os.path.join(output_folder, ZERO_FOLDER), [shapes], keys)
    root, step_folder = os.path.split(output_folder)
    atomic_write_text(os.path.join(root or ".", LATEST_UNIVERSAL), step_folder)
    print("*** Done!")
    return output_folder
