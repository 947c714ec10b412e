"""Inference checkpoints: the documented checkpoint JSON, re-sharding across tensor-parallel sizes, and saving.

Checkpoint JSON (a file path or the same dict)::

    {"type": "ds_model", "version": 1.0, "base_dir": "<dir the file names are relative to>",
     "parallelization": "tp", "tp_size": 2, "dtype": "float32",
     "checkpoints": {"non_tp": ["non-tp.pt"], "tp": ["tp_00_00.pt", "tp_01_00.pt"]}}

``checkpoints`` may also be a plain list. As DeepSpeed reads it (``parallelization`` defaults to "pp"), its
files are parts of one full state dict, loaded in turn (a Hugging Face sharded checkpoint, a single full file);
with ``parallelization: "tp"``, type Megatron or ``training_mp_size`` > 1 they are one file per rank of a
model-parallel run (``tp_size``/``mp_size``/``training_mp_size`` ranks). ``tp`` files are listed part by part,
rank by rank within a part, as DeepSpeed names them (``tp_<rank>_<part>.pt``; file ``i`` belongs to rank
``i % tp_size``); ``non_tp`` files hold replicated tensors. ``type``: 'ds_model', 'bloom' or 'Megatron'.
A directory is read as DeepSpeed's layout (``ds_inference_config.json`` inside it, else
``[<tag from latest>/]mp_rank_XX_model_states.pt``, one file per rank).

Re-sharding goes through full tensors: the shards of every split tensor are put back together (exactly where
the checkpoint records each rank's ``(start, length)`` ranges, as this module writes them; else by
concatenating along the one dimension whose size differs from the model's, as Megatron-style checkpoints are
cut), the full state is loaded into the unsharded model, and AutoTP cuts it for the new size.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CONFIG_NAME", "CheckpointDescription", "describe_checkpoint", "read_full_state_dict",
           "save_tp_checkpoint"]

CONFIG_NAME = "ds_inference_config.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class CheckpointDescription:
    """A parsed checkpoint JSON: resolved file paths and how they were sharded."""

    type: str
    version: float
    base_dir: str
    tp_size: int
    tp_files: list[str]
    non_tp_files: list[str] = field(default_factory=list)
    layouts: dict[str, Any] = field(default_factory=dict)
    parallelization: str = "pp"

    def rank_files(self, rank: int) -> list[str]:
        """The files that hold source rank ``rank``'s shards."""
        return [f for i, f in enumerate(self.tp_files) if i % self.tp_size == rank]


def _from_directory(path: str, training_mp_size: int) -> dict[str, Any]:
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return _read_json(os.path.join(path, CONFIG_NAME))
    tag_dir = path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as handle:
            tag_dir = os.path.join(path, handle.read().strip())
    files = sorted(f for f in os.listdir(tag_dir) if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f))
    if not files:
        raise ValueError(f"checkpoint: directory {path!r} holds neither {CONFIG_NAME} nor "
                         "mp_rank_XX_model_states.pt files")
    return {"type": "ds_model", "version": 1.0, "base_dir": tag_dir, "checkpoints": files, "parallelization": "tp",
            "tp_size": len(files) if training_mp_size == 1 else training_mp_size}


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data.setdefault("base_dir", os.path.dirname(os.path.abspath(path)))
    return data


def _as_dict(checkpoint: str | dict[str, Any], training_mp_size: int) -> dict[str, Any]:
    if isinstance(checkpoint, dict):
        return dict(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint: expected a path or a dict, got {type(checkpoint).__name__}")
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        return _from_directory(path, training_mp_size)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint: {path!r} does not exist")
    if path.endswith(".json"):
        return _read_json(path)
    return {"type": "ds_model", "version": 1.0, "base_dir": os.path.dirname(path),
            "checkpoints": [os.path.basename(path)]}


_TYPES = ("ds_model", "bloom", "megatron")


def _file_lists(data: dict[str, Any], training_mp_size: int) -> tuple[list[str], list[str], int]:
    """(tp files, non-tp files, tp size); see the module docstring for what a plain list means."""
    files = data["checkpoints"]
    declared = data.get("tp_size") or data.get("mp_size")
    if isinstance(files, dict):
        tp_files, non_tp = list(files.get("tp", [])), list(files.get("non_tp", []))
    elif isinstance(files, (list, tuple)) and files:
        per_rank = (data.get("parallelization") == "tp" or training_mp_size > 1
                    or str(data["type"]).lower() == "megatron")
        tp_files, non_tp = (list(files), []) if per_rank else ([], list(files))
    else:
        raise ValueError(f"checkpoint.checkpoints must be a non-empty list or a dict with 'tp'/'non_tp' lists, "
                         f"got {files!r}")
    size = int(declared or (training_mp_size if training_mp_size > 1 else max(len(tp_files), 1)))
    if tp_files and len(tp_files) % size:
        raise ValueError(f"checkpoint: {len(tp_files)} tp files cannot be split over tp_size={size}")
    return tp_files, non_tp, size if tp_files else 1


def describe_checkpoint(checkpoint: str | dict[str, Any], base_dir: str = "",
                        training_mp_size: int = 1) -> CheckpointDescription:
    """Parse a checkpoint path/JSON/dict; ``base_dir`` (the config's) wins over the JSON's own."""
    data = _as_dict(checkpoint, training_mp_size)
    for key in ("type", "checkpoints"):
        if key not in data:
            raise ValueError(f"checkpoint: the checkpoint JSON needs {key!r} (has: {sorted(data)})")
    if str(data["type"]).lower() not in _TYPES:
        raise ValueError(f"checkpoint.type={data['type']!r} is not supported; accepted: 'ds_model', 'bloom', "
                         "'Megatron'")
    if data.get("parallelization", "pp") not in ("tp", "pp"):
        raise ValueError(f"checkpoint.parallelization={data['parallelization']!r}; accepted: 'tp', 'pp'")
    root = base_dir or data.get("base_dir") or ""
    tp_files, non_tp, size = _file_lists(data, training_mp_size)
    join = (lambda f: os.path.join(root, f)) if root else (lambda f: f)
    return CheckpointDescription(type=str(data["type"]), version=float(data.get("version", 1.0)), base_dir=root,
                                 tp_size=size, tp_files=[join(f) for f in tp_files],
                                 non_tp_files=[join(f) for f in non_tp], layouts=data.get("tp_layouts", {}),
                                 parallelization=data.get("parallelization", "pp"))


def _load_file(path: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint: file {path!r} named by the checkpoint does not exist (check base_dir)") from None
    except pickle.UnpicklingError as exc:
        raise ValueError(f"checkpoint: {path!r} holds Python objects besides tensors, which are not loaded "
                         f"(torch.load weights_only=True): {exc}") from None
    for key in ("module", "model"):  # DeepSpeed training checkpoints keep the weights under one of these
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            return state[key]
    return state


def _assemble(key: str, shards: list[torch.Tensor], shape: torch.Size, layout: dict | None) -> torch.Tensor:
    """The full tensor ``key`` from its per-rank shards (identical shards are a replicated tensor)."""
    if layout is not None:
        dim = layout["dim"]
        full = torch.empty(shape, dtype=shards[0].dtype)
        for shard, pieces in zip(shards, layout["pieces"], strict=True):
            offset = 0
            for start, length in pieces:
                full.narrow(dim, start, length).copy_(shard.narrow(dim, offset, length))
                offset += length
        return full
    if all(s.shape == shape for s in shards):
        return shards[0]
    differ = [d for d in range(len(shape)) if shards[0].shape[d] != shape[d]]
    if len(differ) != 1 or sum(s.shape[differ[0]] for s in shards) != shape[differ[0]]:
        raise ValueError(f"checkpoint: shards of {key!r} {[tuple(s.shape) for s in shards]} do not make up the "
                         f"model's shape {tuple(shape)}")
    return torch.cat(shards, dim=differ[0])


def _warn_unexpected(keys: set[str], where: list[str]) -> None:
    """A checkpoint tensor the model has no place for is dropped; say which (as load_state_dict(strict=False)
    reports ``unexpected_keys``), since it usually means a different model or a renamed module."""
    if not keys:
        return
    shown = ", ".join(repr(k) for k in sorted(keys)[:5])
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    warnings.warn(f"checkpoint: {len(keys)} tensor(s) the model does not have were ignored (unexpected keys: "
                  f"{shown}{more}; files: {where})", UserWarning, stacklevel=4)


def read_full_state_dict(desc: CheckpointDescription, model: nn.Module, aliases: dict[str, str] | None = None,
                         known: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()`` at full size, put together from the checkpoint's shards.

    ``aliases`` maps a model key to the checkpoint key it is read from (expert-parallel experts use the global
    numbering); checkpoint keys that are neither the model's, aliased, nor in ``known`` are warned about."""
    aliases = aliases or {}
    expected = model.state_dict()
    common: dict[str, torch.Tensor] = {}
    for path in desc.non_tp_files:
        common.update(_load_file(path))
    ranks = []
    for rank in range(desc.tp_size if desc.tp_files else 0):
        state: dict[str, torch.Tensor] = {}
        for path in desc.rank_files(rank):
            state.update(_load_file(path))
        ranks.append(state)
    full = {}
    for key, target in expected.items():
        source = aliases.get(key, key)
        if source in common:
            full[key] = common[source]
            continue
        shards = [state[source] for state in ranks if source in state]
        if not shards:
            raise ValueError(f"checkpoint: no file holds {source!r} (files: {desc.non_tp_files + desc.tp_files})")
        if len(shards) != len(ranks):
            raise ValueError(f"checkpoint: {source!r} is in {len(shards)} of the {len(ranks)} ranks' files")
        full[key] = _assemble(source, shards, target.shape, desc.layouts.get(source))
    present = set(common).union(*ranks)
    _warn_unexpected(present - set(expected) - set(aliases.values()) - set(known),
                     desc.non_tp_files + desc.tp_files)
    return full


def _layouts(model: nn.Module, plan: dict[str, int | None]) -> dict[str, Any]:
    """Per split parameter, the ``(start, length)`` ranges every rank holds, for exact re-assembly later."""
    out = {}
    for prefix, module in model.named_modules():
        for pname, layout in getattr(module, "_tp_layouts", {}).items():
            name = f"{prefix}.{pname}" if prefix else pname
            if plan.get(name) is not None:
                out[name] = {"dim": plan[name], "full": layout.full,
                             "pieces": [[list(p) for p in rank] for rank in layout.pieces]}
    return out


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_tp_checkpoint(model: nn.Module, path: str, group: Any, plan: dict[str, int | None],
                       ckpt_type: str = "ds_model") -> str:
    """Write this rank's shard (``tp_<rank>_00.pt``) and, on rank 0, the replicated tensors and the JSON.

    Returns the JSON's path. Collective over ``group`` (a barrier, so the files exist when it returns).
    """
    rank = dist.get_rank(group) if group is not None else 0
    size = dist.get_world_size(group) if group is not None else 1
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    split = {k: v for k, v in state.items() if plan.get(k) is not None}
    _atomic_save(split, os.path.join(path, f"tp_{rank:02d}_00.pt"))
    json_path = os.path.join(path, CONFIG_NAME)
    if rank == 0:
        _atomic_save({k: v for k, v in state.items() if k not in split}, os.path.join(path, "non-tp.pt"))
        dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
        description = {"type": ckpt_type, "version": 1.0, "base_dir": os.path.abspath(path),
                       "parallelization": "tp", "tp_size": size, "dtype": _DTYPE_NAMES.get(dtype, str(dtype)),
                       "checkpoints": {"non_tp": ["non-tp.pt"], "tp": [f"tp_{r:02d}_00.pt" for r in range(size)]},
                       "tp_layouts": _layouts(model, plan)}
        tmp = f"{json_path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(description, handle, indent=1)
        os.replace(tmp, json_path)
    if group is not None:
        dist.barrier(group=group)
    return json_path
