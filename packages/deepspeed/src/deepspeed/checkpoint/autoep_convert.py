"""``ds_to_universal`` for a ZeRO-1/2 checkpoint of an AutoEP model (model states holding ``ds_autoep_layers``).

The shared parameters' groups are partitioned over every data-parallel rank, the expert groups over their
expert-data-parallel group only, so the ranks' flat partitions cannot simply be laid end to end. Each rank's
``param_slice_mappings`` (parameter name -> ``start``/``numel`` in that rank's partition, as DeepSpeed's converter
reads them) gives its piece of each parameter: a shared parameter is its pieces in rank order; an expert parameter
is put together per expert-parallel rank and the ranks stacked along the expert dimension
(:func:`deepspeed.checkpoint.autoep_universal.assemble_expert_state`). One parameter's state is in memory at a
time; every file is written atomically, so a crash leaves either no file or a whole one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepspeed.checkpoint._conversion import (
    CAT_DIM,
    OPTIMIZER_STATE_FILE,
    PARAM,
    UniversalConversionError,
    _check_required_state,
    _copy,
    _group_states,
    _model_states_name,
    _optimizer_common,
    _rank_sections,
    _save,
)
from deepspeed.checkpoint.autoep_universal import (
    assemble_expert_state,
    expert_universal_state,
    get_autoep_zero12_expert_param_info,
)
from deepspeed.checkpoint.constants import AUTOEP_LAYERS_KEY
from deepspeed.checkpoint.universal import LATEST_UNIVERSAL, ZERO_FOLDER
from deepspeed.runtime.checkpointing.atomic import atomic_write_text, make_dirs

DATA_FIRST = "use_data_before_expert_parallelism"


def autoep_layers_of(tag_dir: str) -> Any:
    """The ``ds_autoep_layers`` of ``tag_dir``'s model-states file (None: not an AutoEP checkpoint)."""
    from ds_zero import zero_to_fp32 as z

    path = os.path.join(tag_dir, _model_states_name(0))
    return z.load_checkpoint_file(path).get(AUTOEP_LAYERS_KEY) if os.path.isfile(path) else None


def _slices(section: Mapping[str, Any], path: str, groups: int) -> list[dict[str, tuple[int, int]]]:
    """One rank's ``param_slice_mappings`` as ``[{name: (start, numel)}]`` per group."""
    mappings = section.get("param_slice_mappings")
    if not isinstance(mappings, (list, tuple)) or len(mappings) != groups:
        raise UniversalConversionError(f"{path}: 'param_slice_mappings' must list {groups} param groups (found "
                                       f"{type(mappings).__name__}); the AutoEP conversion cuts each rank's "
                                       "partition by it")
    out = []
    for group in mappings:
        entries = {}
        for name, address in dict(group).items():
            start = address["start"] if isinstance(address, Mapping) else getattr(address, "start", None)
            numel = address["numel"] if isinstance(address, Mapping) else getattr(address, "numel", None)
            if not isinstance(start, int) or not isinstance(numel, int):
                raise UniversalConversionError(f"{path}: param_slice_mappings entry of {name!r} is {address!r}, "
                                               "expected start and numel integers")
            entries[name] = (start, numel)
        out.append(entries)
    return out


def _pieces(name: str, g: int, flats: Sequence[torch.Tensor | None], slices: Sequence[list[dict]],
            paths: Sequence[str]) -> dict[int, torch.Tensor]:
    pieces = {}
    for d, (flat, rank_slices) in enumerate(zip(flats, slices, strict=True)):
        where = rank_slices[g].get(name)
        if where is None:
            continue
        start, numel = where
        if flat is None or start + numel > flat.numel():
            raise UniversalConversionError(f"{paths[d]}: the piece of {name!r} ({numel} values from {start}) lies "
                                           f"outside the rank's partition of group {g}")
        pieces[d] = flat.reshape(-1)[start:start + numel].float()
    return pieces


def convert_autoep_zero12(input_folder: str, output_folder: str, inject_missing_state: bool, strict: bool) -> str:
    from ds_zero import zero_to_fp32 as z

    stage, world, sections, paths = _rank_sections(input_folder, 0)
    if stage > 2:
        raise UniversalConversionError(f"{input_folder}: an AutoEP checkpoint of ZeRO stage {stage}; AutoEP trains "
                                       "with ZeRO stages 0-2 here, so only those convert")
    model_file = os.path.join(input_folder, _model_states_name(0))
    main_state = z.load_checkpoint_file(model_file)
    _check_required_state(main_state, inject_missing_state, model_file)
    try:
        info = get_autoep_zero12_expert_param_info(main_state.get(AUTOEP_LAYERS_KEY))
    except RuntimeError as exc:
        raise UniversalConversionError(f"{model_file}: {exc}") from None
    config = main_state.get("ds_config") or {}
    data_first = config.get(DATA_FIRST, False) if isinstance(config, Mapping) else False
    if not isinstance(data_first, bool):
        raise UniversalConversionError(f"{model_file}: ds_config {DATA_FIRST} must be a boolean, got {data_first!r}")
    shapes = z.read_param_shapes(main_state, model_file)
    per_rank = [_group_states(s, stage, p) for s, p in zip(sections, paths, strict=True)]
    slices = [_slices(s, p, len(shapes)) for s, p in zip(sections, paths, strict=True)]
    zero_dir = os.path.join(output_folder, ZERO_FOLDER)
    make_dirs(zero_dir)
    keys = ["fp32"] + [k for k in ("exp_avg", "exp_avg_sq") if all(t is not None for t in per_rank[0][1][k])]
    print(f"Converting AutoEP ZeRO stage {stage} checkpoint {input_folder} ({world} ranks, "
          f"{len(info) // 3} AutoEP layer(s)) to {output_folder}")
    for g, group in enumerate(shapes):
        for name, shape in group.items():
            folder = os.path.join(zero_dir, name)
            make_dirs(folder)
            for key in keys:
                flats = [fp32[g] if key == "fp32" else states[key][g] for fp32, states in per_rank]
                pieces = _pieces(name, g, flats, slices, paths)
                if name in info:
                    full = assemble_expert_state(name, key, pieces, shape, info[name], world, data_first)
                    obj = expert_universal_state(full, info[name]["num_experts"])
                else:
                    value = torch.cat([pieces[d] for d in sorted(pieces)]) if pieces else torch.empty(0)
                    if value.numel() != math.prod(shape):
                        raise UniversalConversionError(f"{input_folder}: the ranks' pieces of {name!r} ({key}) hold "
                                                       f"{value.numel()} values, its shape {tuple(shape)} needs "
                                                       f"{math.prod(shape)}")
                    obj = {PARAM: value.reshape(tuple(shape)), CAT_DIM: 0}
                _save(os.path.join(folder, f"{key}.pt"), obj)
            steps = [states["step"][g] for _, states in per_rank if states["step"][g] is not None]
            if steps:
                if any(not torch.equal(torch.as_tensor(steps[0]), torch.as_tensor(s)) for s in steps[1:]):
                    raise UniversalConversionError(f"{input_folder}: the ranks' optimizer steps of group {g} "
                                                   f"disagree: {steps}")
                _save(os.path.join(folder, "step.pt"), steps[0])
    trained = {name for group in shapes for name in group}
    for name, tensor in (main_state.get("module") or {}).items():  # frozen parameters and buffers
        if isinstance(tensor, torch.Tensor) and name not in trained and tensor.numel():
            make_dirs(os.path.join(zero_dir, name))
            _save(os.path.join(zero_dir, name, "fp32.pt"), {PARAM: tensor.detach().float().clone()})
    _save(os.path.join(zero_dir, OPTIMIZER_STATE_FILE), _optimizer_common(sections[0], stage))
    for file in sorted(os.listdir(input_folder)):
        if file == _model_states_name(0) or (file.startswith("layer_") and file.endswith("_model_states.pt")):
            _copy(os.path.join(input_folder, file), os.path.join(output_folder, file))
    if strict:
        _verify(zero_dir, shapes, keys, info)
    root, step_folder = os.path.split(output_folder)
    atomic_write_text(os.path.join(root or ".", LATEST_UNIVERSAL), step_folder)
    print("*** Done!")
    return output_folder


def _verify(zero_dir: str, shapes: list[Mapping[str, Any]], keys: list[str], info: Mapping[str, Any]) -> None:
    for group in shapes:
        for name, shape in group.items():
            want = math.prod(shape) * (info[name]["ep_size"] if name in info else 1)
            for key in keys:
                path = os.path.join(zero_dir, name, f"{key}.pt")
                got = torch.load(path, map_location="cpu", weights_only=True, mmap=True)[PARAM].numel()
                if got != want:
                    raise UniversalConversionError(f"{path}: {got} values, expected {want}")
