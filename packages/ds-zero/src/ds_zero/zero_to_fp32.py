#!/usr/bin/env python
"""Rebuild consolidated fp32 weights from a ZeRO checkpoint (stage 1, 2 or 3 layout).

ZeRO keeps the fp32 master weights split across the data-parallel ranks' optimizer files; this module
stitches them back into one ``state_dict`` (trainable params from the fp32 partitions, frozen params and
buffers from the model-states file, tied params under every name).

It imports only the standard library and torch (safetensors lazily, when asked for), because the same file
is copied as ``zero_to_fp32.py`` into every checkpoint folder and must run there as a script::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
                           [--max_shard_size 5GB] [--exclude_frozen_parameters] [-d]

Memory: rank files are opened with ``torch.load(mmap=True, weights_only=True)`` and parameters are read one at
a time, so the conversion holds about one output shard plus the largest parameter, not the model twice.
"""

from __future__ import annotations

import argparse
import bisect
import decimal
import glob
import json
import logging
import math
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "LazyTensor",
    "ZeroToFp32Error",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
    # the reader the Universal Checkpoint converters (deepspeed.checkpoint) share with this script
    "MODEL_STATES_RE",
    "OPTIM_STATES_RE",
    "FlatVector",
    "fp32_groups",
    "load_checkpoint_file",
    "optimizer_section",
    "read_param_shapes",
    "stage_and_world",
    "trainable_stage12",
    "trainable_stage3",
]

logger = logging.getLogger("zero_to_fp32")

LATEST_FILE = "latest"
MODEL_STATES_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_BLOCKED_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_OUTPUT_NAMES = {False: ("pytorch_model", ".bin"), True: ("model", ".safetensors")}

# Test hook: called as ``observer(name, tensor)`` each time a LazyTensor is materialised (lets tests count
# how many materialised bytes are alive at once).
_materialise_observer: Callable[[str, torch.Tensor], None] | None = None


class ZeroToFp32Error(ValueError):
    """The checkpoint (or an argument) cannot be converted; the message names the file, key or value."""


# ---------------------------------------------------------------------------------------------- loading


class _Placeholder:
    """Stands in for a class a checkpoint pickles but weights-only loading does not allow (DeepSpeed's loss
    scaler, ``ZeroStageEnum``, ...): keeps constructor arguments and state, runs none of the class's code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __int__(self) -> int:  # an IntEnum member pickles as (cls, (value,))
        if self.args and isinstance(self.args[0], int):
            return self.args[0]
        raise TypeError(f"placeholder {self.args!r} has no integer value")


def _load_once(path: str, placeholders: list[tuple[type, str]]) -> Any:
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
    if zipfile.is_zipfile(path):  # mmap needs the zip format (the default since torch 1.6)
        kwargs["mmap"] = True
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None or not placeholders:
        return torch.load(path, **kwargs)
    with safe_globals(placeholders):
        return torch.load(path, **kwargs)


# Classes DeepSpeed's ZeRO files pickle (the loss scaler, the stage enum), read as placeholders from the first
# attempt on; any other class a file turns out to need is added when found and kept for the next files. Each
# refused attempt costs a whole weights-only unpickling (pure Python), so a rank file's retry doubled its read time.
_PLACEHOLDERS: dict[str, tuple[type, str]] = {
    name: (_Placeholder, name) for name in ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                                            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                                            "deepspeed.runtime.zero.config.ZeroStageEnum",
                                            "deepspeed.utils.tensor_fragment.fragment_address")}
_MAX_PLACEHOLDERS = 256


def _allowed_globals() -> set[str]:
    """Names the process already allows in weights-only loads (``add_safe_globals``: importing deepspeed's
    checkpointing allows its loss scalers): those load as the real classes, not as placeholders."""
    get = getattr(torch.serialization, "get_safe_globals", None)
    entries = get() if get is not None else []
    return {entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}" for entry in entries}


def load_checkpoint_file(path: str) -> Any:
    """``torch.load`` with mmap and weights_only; unknown pickled classes become inert placeholders."""
    while True:
        allowed = _allowed_globals()
        try:
            return _load_once(path, [entry for name, entry in _PLACEHOLDERS.items() if name not in allowed])
        except pickle.UnpicklingError as exc:
            match = _BLOCKED_GLOBAL_RE.search(str(exc))
            if match is None or match.group(1) in _PLACEHOLDERS or len(_PLACEHOLDERS) >= _MAX_PLACEHOLDERS:
                raise ZeroToFp32Error(f"cannot read checkpoint file {path}: {exc}") from exc
            _PLACEHOLDERS[match.group(1)] = (_Placeholder, match.group(1))
        except (OSError, RuntimeError, EOFError) as exc:
            raise ZeroToFp32Error(f"cannot read checkpoint file {path}: {type(exc).__name__}: {exc}") from exc


def _as_int(value: Any, what: str, path: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ZeroToFp32Error(f"{path}: {what} is {value!r}, expected an integer") from exc


# ------------------------------------------------------------------------------------------ lazy tensors


class FlatVector:
    """Several 1-D tensors read as one vector without concatenating them (no copy)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        # detached: DeepSpeed saves its fp32 partitions with requires_grad=True; copying from them as they are
        # would give every output tensor an autograd graph holding each rank's whole partition alive
        self.parts = [part.detach().reshape(-1) for part in parts]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, length: int) -> Iterator[torch.Tensor]:
        """Views covering elements ``[start, start + length)``, in order."""
        end = start + length
        index = bisect.bisect_right(self.starts, start) - 1
        while start < end and index < len(self.parts):
            local = start - self.starts[index]
            take = min(end, self.starts[index + 1]) - start
            if take > 0:
                yield self.parts[index].narrow(0, local, take)
                start += take
            index += 1


class LazyTensor:
    """A tensor of the checkpoint not read yet: ``.contiguous()`` reads it into a new CPU tensor.

    ``shape``, ``dtype``, ``numel()`` and ``nbytes`` are known without reading. ``spans`` lists
    ``(vector, start, length)`` pieces whose concatenation, cut to ``numel()``, is the flat tensor.
    """

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype,
                 spans: list[tuple[FlatVector, int, int]]) -> None:
        self.name, self.shape, self.dtype, self.spans = name, torch.Size(shape), dtype, spans

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the materialised tensor."""
        return self.numel() * self.dtype.itemsize

    def contiguous(self) -> torch.Tensor:
        """Read the tensor (one allocation of ``nbytes``)."""
        numel = self.numel()
        out = torch.empty(numel, dtype=self.dtype)
        filled = 0
        for vector, start, length in self.spans:
            for piece in vector.pieces(start, min(length, numel - filled)):
                out.narrow(0, filled, piece.numel()).copy_(piece)
                filled += piece.numel()
        if filled != numel:
            raise ZeroToFp32Error(f"parameter {self.name!r}: the checkpoint holds {filled} of its {numel} values")
        tensor = out.view(self.shape)
        if _materialise_observer is not None:
            _materialise_observer(self.name, tensor)
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _whole(name: str, shape: Any, tensor: torch.Tensor, path: str) -> LazyTensor:
    """A LazyTensor over one saved tensor holding all of ``shape``'s values (frozen params, buffers)."""
    shape = torch.Size(shape)
    if tensor.numel() != math.prod(shape):
        raise ZeroToFp32Error(f"{path}: {name!r} holds {tensor.numel()} values but its shape {tuple(shape)} "
                              f"needs {math.prod(shape)}")
    return LazyTensor(name, shape, _out_dtype(tensor.dtype), [(FlatVector([tensor]), 0, tensor.numel())])


# ------------------------------------------------------------------------------------- checkpoint files


def _tag_dir(checkpoint_dir: str | os.PathLike, tag: str | None) -> str:
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir!r} does not exist")
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            hint = ("; it looks like a tag folder itself: pass its parent as checkpoint_dir and its name as tag"
                    if any(OPTIM_STATES_RE.match(name) for name in os.listdir(checkpoint_dir)) else "")
            raise FileNotFoundError(f"no tag given and no '{LATEST_FILE}' file at {latest}: pass tag= (e.g. "
                                    f"'global_step14'), or point checkpoint_dir at the folder holding the tag "
                                    f"folders{hint}")
        with open(latest, encoding="utf-8") as handle:
            tag = handle.read().strip()
    tag_dir = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint tag directory {tag_dir!r} does not exist (tag {tag!r})")
    return tag_dir


def _rank_files(tag_dir: str, pattern: re.Pattern[str]) -> dict[int | None, str]:
    """``{dp rank (None when absent): path}`` of model-parallel rank 0's files matching ``pattern``."""
    found: dict[int | None, str] = {}
    for name in sorted(os.listdir(tag_dir)):
        match = pattern.match(name)
        if match is None:
            continue
        if int(match.group(2)) != 0:
            raise ZeroToFp32Error(f"{tag_dir}: {name} belongs to model-parallel rank {int(match.group(2))}; "
                                  "checkpoints with tensor/model parallelism (mp_world_size > 1) are not supported")
        found[None if match.group(1) is None else int(match.group(1))] = os.path.join(tag_dir, name)
    return found


def _natural_key(path: str) -> list[int | str]:
    """Sort key putting ``zero_pp_rank_2`` before ``zero_pp_rank_10`` (numbers compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike, glob_pattern: str) -> list[str]:
    """The files of a tag folder matching ``glob_pattern``, in natural order (DeepSpeed's helper)."""
    files = sorted(glob.glob(os.path.join(os.fspath(checkpoint_dir), glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{os.fspath(checkpoint_dir)}'")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Every rank's ``*_optim_states.pt`` in the tag folder ``checkpoint_dir``, rank 0 first."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Every ``*_model_states.pt`` in the tag folder ``checkpoint_dir`` (one per rank under ZeRO-3), in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def optimizer_section(state: Any, path: str) -> Mapping[str, Any]:
    """The ``optimizer_state_dict`` of a ZeRO optimizer-states file (``path`` names it in errors)."""
    section = state.get("optimizer_state_dict") if isinstance(state, Mapping) else None
    if not isinstance(section, Mapping):
        raise ZeroToFp32Error(f"{path}: no 'optimizer_state_dict' dict; not a ZeRO optimizer-states file")
    return section


def stage_and_world(section: Mapping[str, Any], path: str) -> tuple[int, int]:
    """(ZeRO stage, data-parallel world size) an ``optimizer_state_dict`` section was written with."""
    if "zero_stage" in section:
        stage = _as_int(section["zero_stage"], "'zero_stage'", path)
    else:  # DeepSpeed's bf16 optimizer writes no stage; its layout is stage 1's
        stage = 3 if "fp32_flat_groups" in section else 1
    if stage not in (1, 2, 3):
        raise ZeroToFp32Error(f"{path}: zero_stage is {stage}; only ZeRO stages 1, 2 and 3 can be converted")
    count = section.get("partition_count")
    if count is None:
        raise ZeroToFp32Error(f"{path}: 'optimizer_state_dict' has no 'partition_count'")
    counts = count if isinstance(count, (list, tuple)) else [count]
    return stage, max(_as_int(c, "'partition_count'", path) for c in counts)


def fp32_groups(section: Mapping[str, Any], stage: int, path: str) -> list[torch.Tensor]:
    """A rank's flat fp32 partition of each param group."""
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = section.get(key)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, torch.Tensor) for g in groups):
        raise ZeroToFp32Error(f"{path}: 'optimizer_state_dict' has no list of tensors under {key!r} "
                              f"(needed for a stage-{stage} checkpoint)")
    return list(groups)


def _mics_replicas(ranks: Any, world: int) -> bool:
    """A MiCS checkpoint: ``k`` shard groups of ``world`` (partition_count) ranks each wrote files, ranks
    ``0..k*world-1``; the first group's hold every partition."""
    found = sorted(r for r in ranks if r is not None)
    return len(found) > world and len(found) % world == 0 and found == list(range(len(found)))


def _read_optimizer_files(tag_dir: str) -> tuple[int, int, list[list[torch.Tensor]]]:
    """(zero stage, data-parallel world size, per rank: its fp32 partition of each param group)."""
    files = _rank_files(tag_dir, OPTIM_STATES_RE)
    if not files:
        raise ZeroToFp32Error(f"{tag_dir}: no zero_pp_rank_<r>_mp_rank_00_optim_states.pt files; this is not a "
                              "ZeRO (stage 1-3) checkpoint, whose weights are already whole in the model-states file")
    first = files[min(files)]
    loaded = {min(files): optimizer_section(load_checkpoint_file(first), first)}
    stage, world = stage_and_world(loaded[min(files)], first)
    missing = sorted(set(range(world)) - set(files))
    extra = sorted(set(files) - set(range(world)))
    if extra and _mics_replicas(files, world):  # MiCS: the other shard groups' files replicate ranks 0..world-1
        extra = []
    if missing or extra:
        raise ZeroToFp32Error(
            f"{tag_dir}: the checkpoint was written by {world} data-parallel ranks (partition_count) but "
            f"{len(files)} zero_pp_rank_*_optim_states.pt files are present (missing ranks {missing}, unexpected "
            f"ranks {extra}); a rank failed to save or an older checkpoint was partly overwritten")
    partitions = []
    for rank in range(world):
        section = loaded.pop(rank, None) or optimizer_section(load_checkpoint_file(files[rank]), files[rank])
        found = stage_and_world(section, files[rank])
        if found != (stage, world):
            raise ZeroToFp32Error(f"{files[rank]}: (zero stage, partition count) is {found}, but {first} "
                                  f"says {(stage, world)}")
        partitions.append(fp32_groups(section, stage, files[rank]))
        if len(partitions[-1]) != len(partitions[0]):
            raise ZeroToFp32Error(f"{files[rank]}: {len(partitions[-1])} param groups, but {first} has "
                                  f"{len(partitions[0])}")
    return stage, world, partitions


def _read_model_states(tag_dir: str, stage: int, world: int) -> list[tuple[str, Mapping[str, Any]]]:
    """[(path, model-states dict)]: one file for stage 1/2; stage 3 may have one per rank."""
    files = _rank_files(tag_dir, MODEL_STATES_RE)
    ranked = sorted(rank for rank in files if rank is not None)
    if stage == 3 and ranked:
        if ranked != list(range(world)) and not _mics_replicas(ranked, world):
            raise ZeroToFp32Error(f"{tag_dir}: expected zero_pp_rank_<r>_mp_rank_00_model_states.pt for ranks "
                                  f"0..{world - 1}, found ranks {ranked}")
        paths = [files[rank] for rank in range(world)]
    elif None in files:
        paths = [files[None]]
    else:
        raise ZeroToFp32Error(f"{tag_dir}: no mp_rank_00_model_states.pt file")
    states = [(paths[0], _load_dict(paths[0]))]
    # the other ranks' files add only frozen fragments (and the emptied-shape check below); unread without them
    if len(paths) > 1 and _needs_rank_files(states[0][1]):
        states += [(path, _load_dict(path)) for path in paths[1:]]
    return states


def _load_dict(path: str) -> Mapping[str, Any]:
    state = load_checkpoint_file(path)
    if not isinstance(state, Mapping):
        raise ZeroToFp32Error(f"{path}: expected a dict, found {type(state).__name__}")
    _raise_if_autoep_zero3_partitioned_state(state, path)
    return state


class AutoEPZero3CheckpointError(ZeroToFp32Error, NotImplementedError):
    """A ZeRO-3 AutoEP checkpoint: its experts are partitioned per expert-data-parallel group, so the same expert
    names hold other experts on other ranks; putting partitions together by name would mix them."""


def _raise_if_autoep_zero3_partitioned_state(state: Mapping[str, Any], path: str = "") -> None:
    layers = state.get("ds_autoep_layers")
    if isinstance(layers, list) and any(isinstance(entry, Mapping) and entry.get("checkpoint_format") ==
                                        "zero3_partitioned" for entry in layers):
        raise AutoEPZero3CheckpointError(
            f"{path or 'model states'}: a ZeRO-3 AutoEP checkpoint (ds_autoep_layers with checkpoint_format "
            "'zero3_partitioned') cannot be consolidated by zero_to_fp32; convert it with ds_to_universal.py")


def _raise_if_autoep_zero3_partitioned_checkpoint(model_files: list[str]) -> None:
    """DeepSpeed's check: refuse model-states files of a ZeRO-3 AutoEP checkpoint (see
    :class:`AutoEPZero3CheckpointError`)."""
    for path in model_files:
        _load_dict(path)


def parse_model_states(files: list[str]) -> list[dict[str, Any]]:
    """DeepSpeed's reader of model-states files: per file its fp32 buffers, ``param_shapes``, ``shared_params``,
    ``ds_version`` and frozen parameter shapes and fragments (a ZeRO-3 AutoEP checkpoint is refused)."""
    out = []
    for path in files:
        state = _load_dict(path)
        if "buffer_names" not in state:
            raise ZeroToFp32Error(f"{path} is not a model state checkpoint (no 'buffer_names')")
        names = set(state["buffer_names"] or [])
        module = state.get("module") or {}
        out.append({"buffers": {k: v.float() for k, v in module.items() if k in names},
                    "param_shapes": read_param_shapes(state, path),
                    "shared_params": dict(state.get("shared_params") or {}),
                    "ds_version": state.get("ds_version"),
                    "frozen_param_shapes": state.get("frozen_param_shapes"),
                    "frozen_param_fragments": state.get("frozen_param_fragments")})
    return out


def _needs_rank_files(main: Mapping[str, Any]) -> bool:
    """Whether the other stage-3 model-states files matter: frozen params, or a shape recorded with no elements."""
    if main.get("frozen_param_shapes"):
        return True
    shapes = main.get("param_shapes")
    groups = [shapes] if isinstance(shapes, Mapping) else shapes if isinstance(shapes, (list, tuple)) else []
    try:
        return any(math.prod(shape) == 0 for group in groups for shape in group.values())
    except (AttributeError, TypeError):  # malformed: read them all, read_param_shapes names the problem
        return True


# ------------------------------------------------------------------------------------- reconstruction


def read_param_shapes(model_state: Mapping[str, Any], path: str) -> list[Mapping[str, Any]]:
    """A model-states dict's ``param_shapes``: one ``{name: shape}`` per optimizer param group."""
    shapes = model_state.get("param_shapes")
    if isinstance(shapes, Mapping):
        shapes = [shapes]
    if not isinstance(shapes, (list, tuple)) or not all(isinstance(group, Mapping) for group in shapes):
        raise ZeroToFp32Error(f"{path}: 'param_shapes' is {type(shapes).__name__}, expected a list of "
                              "{name: shape} dicts (one per optimizer param group)")
    return list(shapes)


def trainable_stage12(shapes: list[Mapping[str, Any]], partitions: list[list[torch.Tensor]],
                       world: int, path: str) -> dict[str, LazyTensor]:
    """Each group's flat fp32 vector is the ranks' partitions end to end; params follow in shape order."""
    if len(shapes) != len(partitions[0]):
        raise ZeroToFp32Error(f"{path}: 'param_shapes' lists {len(shapes)} param groups but the optimizer files "
                              f"hold {len(partitions[0])}")
    align = 2 * world
    out: dict[str, LazyTensor] = {}
    for index, group in enumerate(shapes):
        vector = FlatVector([rank_groups[index] for rank_groups in partitions])
        total = sum(math.prod(shape) for shape in group.values())
        padded = align * math.ceil(total / align)
        if total > vector.numel or align * math.ceil(vector.numel / align) != padded:
            raise ZeroToFp32Error(
                f"param group {index}: the {world} rank partitions hold {vector.numel} fp32 values but its "
                f"{len(group)} parameters need {total} ({padded} once padded to a multiple of 2*world_size={align})")
        offset = 0
        for name, shape in group.items():
            if name in out:
                raise ZeroToFp32Error(f"{path}: parameter {name!r} is listed in more than one param group")
            numel = math.prod(shape)
            out[name] = LazyTensor(name, torch.Size(shape), torch.float32, [(vector, offset, numel)])
            offset += numel
    return out


def trainable_stage3(shapes: list[Mapping[str, Any]], partitions: list[list[torch.Tensor]],
                      world: int) -> dict[str, LazyTensor]:
    """Stage 3: every param is split in ``ceil(numel / world)`` slices, one per rank, at the same offset."""
    vectors = [FlatVector(rank_groups) for rank_groups in partitions]
    if len({vector.numel for vector in vectors}) != 1:
        raise ZeroToFp32Error(f"stage 3: rank partitions differ in size: {[v.numel for v in vectors]}")
    out: dict[str, LazyTensor] = {}
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            part = math.ceil(math.prod(shape) / world)
            out[name] = LazyTensor(name, torch.Size(shape), torch.float32,
                                   [(vector, offset, part) for vector in vectors])
            offset += part
    if offset != vectors[0].numel:
        raise ZeroToFp32Error(f"stage 3: the parameters in 'param_shapes' take {offset} values of each rank's "
                              f"partition but each rank holds {vectors[0].numel}")
    return out


def _frozen(states: list[tuple[str, Mapping[str, Any]]], stage: int, world: int) -> dict[str, LazyTensor]:
    """Frozen params at their real shapes: whole in stage 1/2, one fragment per rank file in stage 3."""
    path, main = states[0]
    shapes = main.get("frozen_param_shapes") or {}
    module = main.get("module") or {}
    out: dict[str, LazyTensor] = {}
    for name, shape in shapes.items():
        shape = torch.Size(shape)
        fragments = [(p, (state.get("frozen_param_fragments") or {}).get(name)) for p, state in states]
        if all(fragment is not None for _, fragment in fragments):
            if stage == 3 and len(fragments) == world and world > 1:
                part = math.ceil(math.prod(shape) / world)
                short = [p for p, fragment in fragments if fragment.numel() < part]
                if short:
                    raise ZeroToFp32Error(f"frozen parameter {name!r} {tuple(shape)}: the fragments in {short} hold "
                                          f"fewer than the {part} values each of the {world} ranks should hold")
                spans = [(FlatVector([fragment]), 0, part) for _, fragment in fragments]
                out[name] = LazyTensor(name, shape, _out_dtype(fragments[0][1].dtype), spans)
            else:
                out[name] = _whole(name, shape, fragments[0][1], fragments[0][0])
        elif isinstance(module.get(name), torch.Tensor):
            out[name] = _whole(name, shape, module[name], path)
        else:
            raise ZeroToFp32Error(f"{path}: frozen parameter {name!r} is in 'frozen_param_shapes' but neither "
                                  "'frozen_param_fragments' nor 'module' holds its values")
    return out


def _refuse_emptied_shapes(states: list[tuple[str, Mapping[str, Any]]], groups: list[Mapping[str, Any]]) -> None:
    """A parameter recorded with no elements (``param_shapes`` / ``frozen_param_shapes``) whose values a file
    holds: its shape was read from a released ZeRO-3 parameter (``param.shape``, empty) instead of its full
    shape (``ds_shape``). Converting would write an empty tensor for it without a word."""
    recorded: dict[str, Any] = {name: shape for group in groups for name, shape in group.items()}
    recorded.update(states[0][1].get("frozen_param_shapes") or {})
    for name, shape in recorded.items():
        if math.prod(shape) != 0:
            continue
        for path, state in states:
            for key in ("module", "frozen_param_fragments"):
                value = (state.get(key) or {}).get(name)
                if isinstance(value, torch.Tensor) and value.numel() > 0:
                    raise ZeroToFp32Error(
                        f"{path}: parameter {name!r} is recorded with shape {tuple(shape)} (no elements) but "
                        f"'{key}' holds {value.numel()} values for it; the shape was taken from a released ZeRO-3 "
                        "parameter (param.shape) instead of its full shape (param.ds_shape), and converting would "
                        "write an empty tensor for it")


def _buffers(main: Mapping[str, Any], path: str) -> dict[str, LazyTensor]:
    module = main.get("module") or {}
    names = main.get("buffer_names") or []
    return {name: _whole(name, module[name].shape, module[name], path)
            for name in names if isinstance(module.get(name), torch.Tensor)}


def _shared_pairs(main: Mapping[str, Any], path: str) -> list[tuple[str, str]]:
    shared = main.get("shared_params") or []
    pairs = list(shared.items()) if isinstance(shared, Mapping) else list(shared)
    if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in pairs):
        raise ZeroToFp32Error(f"{path}: 'shared_params' must be a dict alias -> source or a list of "
                              f"[alias, source] pairs, got {shared!r}")
    return [(str(alias), str(source)) for alias, source in pairs]


def _lazy_state_dict(checkpoint_dir: str | os.PathLike, tag: str | None,
                     exclude_frozen_parameters: bool) -> dict[str, LazyTensor]:
    """``{name: LazyTensor}`` in the model's state_dict order; tied names share one LazyTensor object."""
    tag_dir = _tag_dir(checkpoint_dir, tag)
    logger.info("Processing zero checkpoint '%s'", tag_dir)
    stage, world, partitions = _read_optimizer_files(tag_dir)
    states = _read_model_states(tag_dir, stage, world)
    path, main = states[0]
    logger.info("Detected checkpoint of type zero stage %d, world_size: %d, written by deepspeed==%s",
                stage, world, main.get("ds_version"))
    shapes = read_param_shapes(main, path)
    _refuse_emptied_shapes(states, shapes)
    entries = dict(_buffers(main, path))
    if not exclude_frozen_parameters:
        entries.update(_frozen(states, stage, world))
    trainable = (trainable_stage3(shapes, partitions, world) if stage == 3
                 else trainable_stage12(shapes, partitions, world, path))
    clash = sorted(set(entries) & set(trainable))
    if clash:
        raise ZeroToFp32Error(f"{path}: names listed both as trainable and as frozen params or buffers: {clash}")
    entries.update(trainable)
    for alias, source in _shared_pairs(main, path):
        if source in entries:
            entries[alias] = entries[source]
    module_order = {name: i for i, name in enumerate(main.get("module") or {})}
    ordered = sorted(entries, key=lambda name: module_order.get(name, len(module_order)))
    for name in ordered:
        logger.debug("%s: shape %s, %s", name, tuple(entries[name].shape), entries[name].dtype)
    logger.info("Reconstructed state dict: %d tensors, %d trainable params, %d elements in all", len(entries),
                len(trainable), sum(t.numel() for t in {id(t): t for t in entries.values()}.values()))
    return {name: entries[name] for name in ordered}


# ----------------------------------------------------------------------------------------- public API


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """The consolidated fp32 ``state_dict`` of a ZeRO 1/2/3 checkpoint, on CPU.

    ``tag`` None reads ``<checkpoint_dir>/latest``. Tied params appear under every name (the same tensor).
    ``lazy_mode``: values are :class:`LazyTensor` objects; ``.contiguous()`` reads one when needed.
    """
    entries = _lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    if lazy_mode:
        return entries
    read: dict[int, torch.Tensor] = {}
    for lazy in entries.values():
        if id(lazy) not in read:  # tied names share one tensor, as in the model
            read[id(lazy)] = lazy.contiguous()
    return {name: read[id(lazy)] for name, lazy in entries.items()}


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to CPU and load the checkpoint's fp32 weights into it; returns the model.

    Names the model lacks are an error (wrong model); model entries absent from the checkpoint are kept
    as they are, with a warning.
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    expected = set(model.state_dict())
    unexpected = sorted(set(state_dict) - expected)
    if unexpected:
        raise ZeroToFp32Error(f"the checkpoint holds {len(unexpected)} entries the model does not have "
                              f"(first: {unexpected[:5]}); is this the model the checkpoint was saved from?")
    missing = sorted(expected - set(state_dict))
    if missing:
        logger.warning("the checkpoint has no values for %d model entries (kept as they are): %s",
                       len(missing), missing[:10])
    model.load_state_dict(state_dict, strict=False)
    return model


def _parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a string like '5GB' (10**9), '500MiB' (2**20), '1024'."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        if match is None or (match.group(2) or "B").upper() not in _SIZE_UNITS:
            raise ZeroToFp32Error(f"max_shard_size={value!r} is not a size; use an int of bytes or a string "
                                  "like '5GB', '500MB', '2GiB'")
        size = int(decimal.Decimal(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").upper()])
    if size <= 0:
        raise ZeroToFp32Error(f"max_shard_size={value!r} must be positive")
    return size


def _plan_shards(entries: Mapping[str, LazyTensor], max_bytes: float, share_storage: bool) -> list[list[str]]:
    """Names per shard, in order, each shard at most ``max_bytes`` unless one tensor alone is larger.

    With ``share_storage`` (.bin files) a tied name costs nothing when its tensor is already in the shard."""
    shards: list[list[str]] = [[]]
    size, held = 0, set()
    for name, lazy in entries.items():
        cost = 0 if share_storage and id(lazy) in held else lazy.nbytes
        if shards[-1] and size + cost > max_bytes:
            shards.append([])
            size, held = 0, set()
            cost = lazy.nbytes
        shards[-1].append(name)
        size += cost
        held.add(id(lazy))
    return shards


def _shard_names(count: int, safe: bool) -> list[str]:
    stem, ext = _OUTPUT_NAMES[safe]
    if count == 1:
        return [stem + ext]
    return [f"{stem}-{i:05d}-of-{count:05d}{ext}" for i in range(1, count + 1)]


def _save_shard(tensors: dict[str, torch.Tensor], path: str, safe: bool) -> None:
    """Write atomically: temporary name, fsync, rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        if safe:
            from safetensors.torch import save_file

            save_file(tensors, tmp, metadata={"format": "pt"})
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        else:
            with open(tmp, "wb") as handle:
                torch.save(tensors, handle)
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _remove_stale_outputs(output_dir: str, safe: bool, written: set[str]) -> None:
    """Drop weight files of the same format left by an earlier conversion (a loader could pick them up)."""
    stem, ext = _OUTPUT_NAMES[safe]
    stale = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?{re.escape(ext)}(\.index\.json)?$")
    for name in os.listdir(output_dir):
        if stale.match(name) and name not in written:
            logger.info("Removing stale %s", name)
            os.remove(os.path.join(output_dir, name))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the consolidated fp32 state_dict under ``output_dir`` as Hugging Face names it.

    One shard: ``pytorch_model.bin`` (or ``model.safetensors``); more: ``pytorch_model-0000i-of-0000n.bin``
    (``model-0000i-of-0000n.safetensors``) plus ``<name>.index.json`` with ``metadata.total_size`` (bytes)
    and ``weight_map``. ``max_shard_size`` None: one file. Shards are written as they fill, one parameter read
    at a time.
    """
    max_bytes = math.inf if max_shard_size is None else _parse_size(max_shard_size)
    if safe_serialization:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            raise ZeroToFp32Error("safe_serialization=True needs the 'safetensors' package "
                                  "(pip install safetensors)") from exc
    entries = _lazy_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    shards = _plan_shards(entries, max_bytes, share_storage=not safe_serialization)
    file_names = _shard_names(len(shards), safe_serialization)
    weight_map: dict[str, str] = {}
    total_size = 0
    for names, file_name in zip(shards, file_names, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        read: dict[int, torch.Tensor] = {}
        for name in names:
            lazy = entries[name]
            if safe_serialization or id(lazy) not in read:  # safetensors refuses shared storage
                read[id(lazy)] = lazy.contiguous()
                total_size += lazy.nbytes
            tensors[name] = read[id(lazy)]
            weight_map[name] = file_name
        logger.info("Saving %s (%d tensors)", file_name, len(tensors))
        _save_shard(tensors, os.path.join(output_dir, file_name), safe_serialization)
        del tensors, read
    written = set(file_names)
    if len(shards) > 1:
        stem, ext = _OUTPUT_NAMES[safe_serialization]
        index_name = f"{stem}{ext}.index.json"
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        _write_text(os.path.join(output_dir, index_name), json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.add(index_name)
    _remove_stale_outputs(output_dir, safe_serialization, written)


# ---------------------------------------------------------------------------------------------- script


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32", description="Consolidate a ZeRO checkpoint's fp32 weights into a state_dict.")
    parser.add_argument("checkpoint_dir", help="the folder holding the tag folders, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="where the fp32 state_dict files go, e.g. path/checkpoint-12-output/")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest shard before splitting (default 5GB; e.g. 500MB, 2GiB or bytes)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors files instead of pickled torch files")
    parser.add_argument("-t", "--tag", default=None,
                        help="checkpoint tag, e.g. global_step1 (default: the one named in 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen params out")
    parser.add_argument("-d", "--debug", action="store_true", help="log every tensor")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (``zero_to_fp32.py`` / ``ds-zero-to-fp32``); returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if args.debug else logging.INFO)
    logger.propagate = False  # the script prints its own progress; no duplicates through the root logger
    try:
        convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"zero_to_fp32: error: {exc}", file=sys.stderr)
        return 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    return 0


if __name__ == "__main__":
    sys.exit(main())
