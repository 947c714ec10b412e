"""ZeRO-3 AutoEP checkpoints into a Universal Checkpoint.

At ZeRO-3 an AutoEP expert parameter (``<prefix>.experts.w1|w2|w3``, this expert-parallel rank's experts) is
partitioned over its expert-data-parallel group, not over every rank: its optimizer sub-group is listed in the
rank's ``ds_zero_partition_groups`` (partition count, this rank's place, the group's global ranks), and the rank's
``ds_autoep_layers`` entries (``checkpoint_format: zero3_partitioned``) give its ``ep_rank``. The whole expert
tensor is each expert-data-parallel group's partitions in partition order (padding cut), the groups in
``ep_rank`` order: ``[num_experts, ...]``, written with ``is_expert_param`` so a universal load takes each rank's
rows (``ds_zero.checkpoint.read_universal``). Other parameters are partitioned over every rank as usual.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepspeed.checkpoint._conversion import STATE_KEYS, UniversalConversionError, _group_states
from deepspeed.checkpoint.constants import (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    AUTOEP_NUM_EXPERTS,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY,
    AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT,
)
from deepspeed.checkpoint.state_metadata import read_plain_entries
from ds_zero.zero3.checkpoint import PARTITION_GROUPS

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def uses_partitioned_experts(sections: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the ranks' ZeRO-3 optimizer sections hold sub-groups partitioned over expert groups."""
    return any(section.get(PARTITION_GROUPS) for section in sections)


def _uses_zero3_partitioned_autoep_metadata(layers: Any) -> bool:
    """Whether ``ds_autoep_layers`` entries say the experts are saved as ZeRO-3 partitions (DeepSpeed's name)."""
    return isinstance(layers, list) and any(
        isinstance(entry, Mapping) and entry.get(AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY) ==
        AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT for entry in layers)


def _ep_rank(model_state: Mapping[str, Any], path: str) -> int:
    layers = model_state.get(AUTOEP_LAYERS_KEY)
    if not _uses_zero3_partitioned_autoep_metadata(layers):
        raise UniversalConversionError(f"{path}: ZeRO-3 expert partitions without ds_autoep_layers entries of "
                                       f"{AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY} "
                                       f"'{AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT}'")
    ranks = {int(entry["ep_rank"]) for entry in layers}
    if len(ranks) != 1:
        raise UniversalConversionError(f"{path}: AutoEP layers of one rank name several ep_rank values {ranks}")
    return ranks.pop()


def read_autoep_layers(model_files: Sequence[str]) -> list[Any]:
    """Each file's ``ds_autoep_layers`` (None where it has none), read from the pickle alone: the model states of a
    ZeRO-3 rank are not unpickled whole (nor their tensors mapped) for a few integers."""
    return [read_plain_entries(path, [AUTOEP_LAYERS_KEY]).get(AUTOEP_LAYERS_KEY) for path in model_files]


def read_ep_ranks(model_files: Sequence[str]) -> list[int]:
    """The ``ep_rank`` each ZeRO-3 AutoEP rank's model-states file records, in file order."""
    return [_ep_rank({AUTOEP_LAYERS_KEY: layers}, path)
            for layers, path in zip(read_autoep_layers(model_files), model_files, strict=True)]


def _expert_counts(layers: Any, path: str) -> dict[str, int]:
    """``{expert parameter name: num_experts}`` of ``ds_autoep_layers`` (every layer's ``<prefix>.w1|w2|w3``)."""
    try:
        return {f"{entry[AUTOEP_EXPERT_KEY_PREFIX]}.{w}": int(entry[AUTOEP_NUM_EXPERTS])
                for entry in layers for w in EXPERT_WEIGHTS}
    except (KeyError, TypeError, ValueError) as exc:
        raise UniversalConversionError(f"{path}: ds_autoep_layers entries need '{AUTOEP_EXPERT_KEY_PREFIX}' and "
                                       f"'{AUTOEP_NUM_EXPERTS}' ({type(exc).__name__}: {exc})") from exc


def _whole_expert_shape(name: str, shape: Sequence[int], groups: int, counts: Mapping[str, int],
                        path: str) -> torch.Size:
    """``[num_experts, ...]`` of an expert parameter whose per-rank shape is ``shape``, from ``groups``
    expert-parallel ranks; refused unless that is exactly the ``num_experts`` its AutoEP layer records."""
    if name not in counts:
        raise UniversalConversionError(f"{path}: parameter {name!r} is partitioned over an expert group but no "
                                       f"ds_autoep_layers entry names it (expert parameters: {sorted(counts)})")
    found = torch.Size([shape[0] * groups, *shape[1:]])
    expected = torch.Size([counts[name], *shape[1:]])
    if found != expected:
        raise UniversalConversionError(
            f"{path}: expert parameter {name!r}: its {groups} expert-parallel ranks hold {found.numel()} values "
            f"({tuple(found)}), expected {expected.numel()} ({tuple(expected)}: {counts[name]} experts as "
            "ds_autoep_layers records); the ranks' ep_rank or partition-group records do not fit together")
    return found


def _expert_groups(sub_group: int, metas: Sequence[Mapping[int, Mapping[str, Any]]], ep_ranks: Sequence[int],
                   path: str) -> list[list[int]]:
    """The expert-data-parallel groups (global ranks in partition order) of ``sub_group``, in ``ep_rank`` order;
    one per expert-parallel rank."""
    by_ep: dict[int, list[int]] = {}
    for rank, meta in enumerate(metas):
        entry = meta.get(sub_group)
        if entry is None:
            raise UniversalConversionError(f"{path}: rank {rank} has no {PARTITION_GROUPS} entry for sub-group "
                                           f"{sub_group}; the ranks saved different layouts")
        ranks = [int(r) for r in entry["partition_ranks"]]
        known = by_ep.setdefault(ep_ranks[rank], ranks)
        if known != ranks:
            raise UniversalConversionError(f"{path}: ep_rank {ep_ranks[rank]} has partition ranks {known} and {ranks}")
    if sorted(by_ep) != list(range(len(by_ep))):
        raise UniversalConversionError(f"{path}: expert-parallel ranks {sorted(by_ep)} are not 0..{len(by_ep) - 1}")
    return [by_ep[ep] for ep in range(len(by_ep))]


def expert_lazy_states(sections: Sequence[Mapping[str, Any]], paths: Sequence[str], model_files: Sequence[str],
                       shapes: Sequence[Mapping[str, Any]]
                       ) -> tuple[dict[str, dict[str, Any]], dict[int, Any], dict[str, int]]:
    """``({state key: {name: LazyTensor}}, {sub-group: step}, {expert name: values of the whole expert tensor})``
    of a ZeRO-3 AutoEP checkpoint (``_conversion._lazy_states`` for this layout): ``sections`` and ``paths``
    every rank's optimizer section and file, ``model_files`` every rank's model-states file (its ``ep_rank`` and
    the layers' ``num_experts``), ``shapes`` the ``param_shapes`` (one dict per sub-group; expert shapes are per
    rank). An expert tensor that would not be exactly ``num_experts`` experts is refused."""
    from ds_zero import zero_to_fp32 as z

    world = len(sections)
    layers = read_autoep_layers(model_files)
    ep_ranks = [_ep_rank({AUTOEP_LAYERS_KEY: entries}, path) for entries, path in zip(layers, model_files,
                                                                                       strict=True)]
    counts = _expert_counts(layers[0], model_files[0])
    metas = [{int(e["sub_group"]): e for e in (section.get(PARTITION_GROUPS) or [])} for section in sections]
    per_rank = [_group_states(section, 3, path) for section, path in zip(sections, paths, strict=True)]
    out: dict[str, dict[str, Any]] = {}
    experts: dict[str, int] = {}
    for key in STATE_KEYS:
        parts = [fp32 for fp32, _ in per_rank] if key == "fp32" else [states[key] for _, states in per_rank]
        if any(t is None for rank in parts for t in rank):
            continue
        vectors = [z.FlatVector(rank_groups) for rank_groups in parts]
        lazy: dict[str, Any] = {}
        offset = 0
        for g, group in enumerate(shapes):
            groups = _expert_groups(g, metas, ep_ranks, paths[0]) if g in metas[0] else None
            count = len(groups[0]) if groups else world
            for name, shape in group.items():
                numel = math.prod(shape)
                part = math.ceil(numel / count) if numel else 0
                if groups is None:
                    lazy[name] = z.LazyTensor(name, torch.Size(shape), torch.float32,
                                              [(vector, offset, part) for vector in vectors])
                else:  # each group's partitions, padding cut, then the next expert-parallel rank's
                    spans = [(vectors[r], offset, min(part, numel - k * part))
                             for ranks in groups for k, r in enumerate(ranks) if numel - k * part > 0]
                    whole = _whole_expert_shape(name, shape, len(groups), counts, model_files[0])
                    lazy[name] = z.LazyTensor(name, whole, torch.float32, spans)
                    experts[name] = whole.numel()
                offset += part
        if offset != vectors[0].numel:
            raise UniversalConversionError(f"{paths[0]}: the parameters in 'param_shapes' take {offset} values of "
                                           f"each rank's partition but it holds {vectors[0].numel}")
        out[key] = lazy
    steps = {g: step for g, step in enumerate(per_rank[0][1]["step"]) if step is not None}
    return out, steps, experts


def _get_zero3_model_state_files(checkpoint_dir: str) -> list[str]:
    """The ``zero_pp_rank_<r>_mp_rank_XX_model_states.pt`` files of a ZeRO-3 tag folder, by rank (DeepSpeed's name)."""
    from ds_zero import zero_to_fp32 as z

    return [path for path in z.get_model_state_files(checkpoint_dir)
            if os.path.basename(path).startswith("zero_pp_rank_")]


def _autoep_expert_param_names_by_rank(model_files: Sequence[str]) -> tuple[set[str], dict[int, list[Any]]]:
    """``(expert parameter names, {rank: ds_autoep_layers})`` of ZeRO-3 model-states files (DeepSpeed's name):
    every AutoEP layer's ``<expert_key_prefix>.w1|w2|w3``."""
    names: set[str] = set()
    by_rank: dict[int, list[Any]] = {}
    for rank, layers in enumerate(read_autoep_layers(model_files)):
        by_rank[rank] = layers or []
        names.update(f"{entry[AUTOEP_EXPERT_KEY_PREFIX]}.{w}" for entry in by_rank[rank] for w in EXPERT_WEIGHTS)
    return names, by_rank
