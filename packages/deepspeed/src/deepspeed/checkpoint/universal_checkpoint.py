"""``deepspeed.checkpoint.universal_checkpoint``: cutting one tensor-parallel rank's piece out of a Universal
Checkpoint's full tensors (the restore side of ``ds_to_universal``), by DeepSpeed's rules and names.

A universal parameter file (``zero/<name>/<state>.pt``) holds ``{"param": full tensor, ...}`` plus how the
converter merged it: ``cat_dim`` (the dimension the ranks' slices were concatenated along), ``param_n_sub_params``
(a fused weight of that many equal sub-parameters), ``sub_param_shape`` (a :class:`SubparamShape`: fused
sub-parameters of possibly different widths), ``vocab_tensor`` (an embedding whose TP padding was stripped) and
the expert-parallel keys. An AutoTP parameter can also carry its own restore description as the attribute
``ds_autotp_universal_checkpoint_meta`` (``partition_dim``, ``logical_shape``, ``partition_sizes``,
``sub_param_sizes``, ``sub_param_shard_widths``, ``replicated``, ...); when present it decides the cut, since it
records uneven splits exactly where the file's keys can only describe even ones.

:func:`load_hp_checkpoint_state` is the method DeepSpeed binds to each low-precision parameter
(:func:`enable_universal_checkpoint`): it reads every state file of the parameter's folder and copies this rank's
fragment (``param._hp_mapping``: where the parameter's piece of this rank's fp32 partition starts) into the fp32
master (``fp32``) or into ``_hp_mapping.optim_fragment`` (the optimizer moments). Layout errors raise
:class:`UniversalLayoutError`, an ``AssertionError`` (DeepSpeed asserts these) that is also a ``ValueError``.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    CAT_DIM,
    DS_AUTOTP_UC_META,
    EP_IS_EXPERT_PARAM,
    EP_NUM_EXPERTS,
    FP32_WEIGHT_KEY,
    PARAM,
    PARAM_N_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
)

# the first universal-checkpoint version whose fused parameters record per-rank widths (sub_param_shard_widths)
SHARD_WIDTHS_VERSION = 0.4


class UniversalLayoutError(AssertionError, ValueError):
    """A universal tensor and the layout recorded for it disagree (or the layout cannot be rebuilt)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UniversalLayoutError(message)


@dataclass
class SubparamShape:
    """A fused parameter made of sub-parameters (e.g. Q, K and V) that tensor parallelism cuts one by one.

    ``shape``: the parameter's logical shape, where the entry at ``partition_dim`` is either the tuple of the
    sub-parameters' widths along it or (older metadata) their count; ``-1`` marks a dimension inferred from the
    element count. ``patterns``: the parameter-name regexes it applies to. Pickled into universal files under
    ``sub_param_shape``, so its module path and fields are part of the file format.
    """

    patterns: list[str]
    shape: tuple[tuple[int, ...] | int, ...]
    partition_dim: int


# plain data (lists, tuples, ints): universal files holding one still load with torch.load(weights_only=True)
torch.serialization.add_safe_globals([SubparamShape])


def _get_param_uc_restore_meta(param: Any) -> Mapping[str, Any] | None:
    """The AutoTP restore description attached to ``param`` (its top-level keys drive the cut; ``conversion``
    holds what the converter needs), or None for a parameter without one."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def even_widths(sizes: Sequence[int], tp_world_size: int) -> list[list[int]]:
    """Per-rank widths of sub-parameters split evenly over ``tp_world_size`` ranks (the only layout checkpoints
    without recorded widths can have); refuses sizes that do not divide, whose real layout is unknown."""
    uneven = [int(size) for size in sizes if int(size) % tp_world_size]
    _require(not uneven, f"Sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_world_size}, and the "
                         "checkpoint records no sub_param_shard_widths, so its uneven layout cannot be rebuilt")
    return [[int(size) // tp_world_size] * tp_world_size for size in sizes]


def check_widths(sizes: Sequence[int], widths: Sequence[Sequence[int]], tp_world_size: int, what: str) -> None:
    """``widths[i][r]``: rank ``r``'s width of sub-parameter ``i``; one entry per sub-parameter and rank, summing
    to the sub-parameter's size."""
    _require(len(widths) == len(sizes), f"{what}: {len(widths)} shard-width entries for {len(sizes)} sub-parameters")
    for size, per_rank in zip(sizes, widths, strict=True):
        _require(len(per_rank) == tp_world_size, f"{what}: a sub-parameter of size {size} has {len(per_rank)} shard "
                                                 f"widths, expected one per tensor-parallel rank ({tp_world_size})")
        _require(sum(per_rank) == size, f"{what}: shard widths {list(per_rank)} sum to {sum(per_rank)}, the "
                                        f"sub-parameter has {size}")


def narrow_sub_params(full: torch.Tensor, dim: int, sizes: Sequence[int], widths: Sequence[Sequence[int]],
                      tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s piece of each sub-parameter of ``full`` along ``dim``, concatenated in order."""
    _require(sum(sizes) == full.shape[dim], f"sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, but dimension "
                                            f"{dim} of the parameter is {full.shape[dim]}")
    pieces, offset = [], 0
    for size, per_rank in zip(sizes, widths, strict=True):
        pieces.append(full.narrow(dim, offset + sum(per_rank[:tp_rank]), per_rank[tp_rank]))
        offset += size
    return torch.cat(pieces, dim=dim)


def _narrow_sub_params(full_view: torch.Tensor, partition_dim: int, sub_dim_sizes: Sequence[int],
                       shard_widths: Sequence[Sequence[int]] | None, tp_rank: int, tp_world_size: int,
                       uc_version: float) -> torch.Tensor:
    """Rank ``tp_rank``'s piece of every sub-parameter of ``full_view`` (flattened): by the recorded per-rank
    ``shard_widths``, or, for metadata older than version 0.4 (which records none), by an even split."""
    version = float(uc_version)
    if version < SHARD_WIDTHS_VERSION:
        shard_widths = even_widths(sub_dim_sizes, tp_world_size)
    _require(shard_widths is not None, f"AutoTP restore metadata of version {version} records no "
                                       "sub_param_shard_widths for its fused sub-parameters")
    check_widths(sub_dim_sizes, shard_widths, tp_world_size, "AutoTP restore metadata")
    return narrow_sub_params(full_view, partition_dim, sub_dim_sizes, shard_widths, tp_rank).flatten()


def _sub_param_sizes(meta: Mapping[str, Any], dim: int) -> tuple[Sequence[int] | None, int]:
    """(widths of the fused sub-parameters along the split dimension, that dimension), from ``sub_param_sizes``
    or, for older metadata, the ``sub_param_shape`` entry (which may name its own partition dimension)."""
    if meta.get("sub_param_sizes") is not None:
        return tuple(meta["sub_param_sizes"]), dim
    spec = meta.get("sub_param_shape")
    if spec is None:
        return None, dim
    if hasattr(spec, "shape") and hasattr(spec, "partition_dim"):
        spec, dim = spec.shape, spec.partition_dim
    sizes = spec[dim]
    return (tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)), dim


def _resolve_autotp_partition(current_param: Any, ckpt_dict: Mapping[str, Any], full_hp_param: torch.Tensor,
                              tp_rank: int, tp_world_size: int) -> torch.Tensor | None:
    """This rank's flat slice of ``full_hp_param`` by the parameter's AutoTP restore description, or None when
    it has none (the caller then cuts by the file's own keys). ``ckpt_dict``: the file (unused by the rules)."""
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    reason = (meta.get("conversion") or {}).get("unsupported_reason")
    if reason:
        raise RuntimeError(f"Cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        _require(dim is None, f"a replicated AutoTP parameter records partition_dim={dim!r}; expected None")
        return full_hp_param.flatten()
    if dim is None or meta.get("logical_shape") is None:
        return None
    full = full_hp_param.view(tuple(meta["logical_shape"]))
    sizes, dim = _sub_param_sizes(meta, dim)
    if sizes is not None:
        return _narrow_sub_params(full, dim, sizes, meta.get("sub_param_shard_widths"), tp_rank, tp_world_size,
                                  meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
    partition_sizes = meta.get("partition_sizes")
    if partition_sizes is not None:
        _require(len(partition_sizes) == tp_world_size and sum(partition_sizes) == full.shape[dim],
                 f"partition_sizes {list(partition_sizes)} do not cut dimension {dim} ({full.shape[dim]}) into "
                 f"{tp_world_size} ranks")
        return full.narrow(dim, sum(partition_sizes[:tp_rank]), partition_sizes[tp_rank]).flatten()
    # an uneven split gives the remainder to the low ranks, which chunk() does not reproduce: refuse to guess
    _require(full.shape[dim] % tp_world_size == 0,
             f"Dimension {dim} of size {full.shape[dim]} is not divisible by tp_world_size {tp_world_size}, and this "
             "checkpoint records no partition_sizes, so its uneven layout cannot be rebuilt")
    return full.chunk(tp_world_size, dim=dim)[tp_rank].flatten()


def cut_by_file_keys(ckpt_dict: Mapping[str, Any], full: torch.Tensor, tp_rank: int,
                     tp_world_size: int) -> torch.Tensor:
    """The inverse of the converter's merge recorded in the file: sub-parameters cut one by one (evenly: such
    files record no widths), or the whole tensor cut along ``cat_dim``."""
    sub_shape = ckpt_dict.get(SUB_PARAM_SHAPE)
    dim = ckpt_dict.get(CAT_DIM, 0)
    count = ckpt_dict.get(PARAM_N_SUB_PARAMS, 1)
    if sub_shape:
        dim = sub_shape.partition_dim
        sizes = sub_shape.shape[dim]
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
        logical = [sum(d) if isinstance(d, (tuple, list)) else d for d in sub_shape.shape]
        view = full.view(logical)
        return narrow_sub_params(view, dim, sizes, even_widths(sizes, tp_world_size), tp_rank).flatten()
    if count > 1:
        subs = full.chunk(count, dim=dim)
        return torch.cat([sub.chunk(tp_world_size, dim=dim)[tp_rank] for sub in subs], dim=dim).flatten()
    return full.chunk(tp_world_size, dim=dim)[tp_rank].flatten()


def _state_keys(folder: str) -> list[str]:
    return sorted(name[:-3] for name in os.listdir(folder) if name.endswith(".pt") and len(name) > 3)


def _expert_slice(ckpt_dict: Mapping[str, Any], full: torch.Tensor, ep_rank: int, ep_size: int,
                  path: str) -> torch.Tensor:
    """An expert parameter's experts of this expert-parallel rank (universal files hold all of them on dim 0)."""
    experts = ckpt_dict.get(EP_NUM_EXPERTS)
    _require(experts is not None, f"{path}: an expert parameter without '{EP_NUM_EXPERTS}'")
    _require(full.shape[0] == experts, f"{path}: expert dimension {full.shape[0]} != {EP_NUM_EXPERTS} {experts}")
    _require(experts % ep_size == 0, f"{path}: {experts} experts do not divide over ep_size {ep_size}")
    local = experts // ep_size
    return full[ep_rank * local:(ep_rank + 1) * local]


def _pad_vocab(full: torch.Tensor, rows: int, path: str) -> torch.Tensor:
    """An embedding stored without padding, padded with zero rows to ``rows`` (this TP size's padded vocab)."""
    _require(rows >= full.shape[0], f"{path}: padded vocabulary {rows} < the stored {full.shape[0]} rows")
    return torch.nn.functional.pad(full, (0, 0, 0, rows - full.shape[0])) if rows > full.shape[0] else full


def load_hp_checkpoint_state(self: Any, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0,
                             ep_size: int = 1) -> Any:
    """Fill this parameter's fp32 fragment and optimizer-state fragments from its universal folder ``folder``
    (bound as a method of the parameter); returns the folder's ``step`` (None without ``step.pt``)."""
    mapping = self._hp_mapping
    mapping.optim_fragment = {}
    has_meta = _get_param_uc_restore_meta(self) is not None
    step = None
    for key in _state_keys(folder):
        path = os.path.join(folder, f"{key}.pt")
        ckpt_dict = torch.load(path, weights_only=False)  # may hold a pickled SubparamShape
        if key == "step":
            step = ckpt_dict
            continue
        full = ckpt_dict[PARAM]
        expert = ckpt_dict.get(EP_IS_EXPERT_PARAM, False)
        if expert and ep_size > 1:
            full = _expert_slice(ckpt_dict, full, ep_rank, ep_size, path)
        rank, world = tp_rank, tp_world_size
        if full.shape == self.shape and not has_meta:  # stored whole (replicated or averaged): copied as is
            rank, world = 0, 1
        if ckpt_dict.get(VOCAB_TENSOR, False) and not expert and not has_meta:
            full = _pad_vocab(full, self.shape[0] * world, path)
        tp_slice = _resolve_autotp_partition(self, ckpt_dict, full, rank, world)
        if tp_slice is None:
            _require(full.numel() == world * self.numel(), f"Loading {path}: full param numel {full.numel()} != "
                                                           f"tensor slice numel {self.numel()} * tp_world_size {world}")
            tp_slice = cut_by_file_keys(ckpt_dict, full, rank, world)
        address = mapping.lp_fragment_address
        fragment = tp_slice.narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            target = mapping.get_hp_fragment()
            _require(target.numel() == address.numel, f"Loading {path}: fp32 fragment of {target.numel()} values, "
                                                      f"the checkpoint's fragment has {address.numel}")
            target.data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step


def enable_universal_checkpoint(param_list: Iterable[torch.nn.Parameter]) -> None:
    """Bind :func:`load_hp_checkpoint_state` to each parameter (DeepSpeed's ZeRO 1/2 and bf16 optimizers do)."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)
