"""``deepspeed.checkpoint.autoep_universal``: AutoEP expert weights and optimizer states put back together into
DeepSpeed's Universal Checkpoint layout, so that a checkpoint saved at one ``autoep_size`` loads at another.

An AutoEP layer holds ``num_local_experts = num_experts / ep_size`` experts per expert-parallel rank as the fused
parameters ``<prefix>.w1`` / ``w3`` ``[E_local, ffn, hidden]`` and ``<prefix>.w2`` ``[E_local, hidden, ffn]``
(``prefix`` = ``<module path>.experts``). The model-states file lists the layers under ``ds_autoep_layers``.
Under ZeRO-1/2 an expert parameter group is partitioned over its expert-data-parallel group only, so data-parallel
rank ``d``'s file holds a piece of the experts of one expert-parallel rank:

- experts first (DeepSpeed's default): expert-parallel rank ``r`` is held by ranks ``r, r + ep, r + 2 ep, ...``;
- ``use_data_before_expert_parallelism``: by the consecutive ranks ``r * edp ... (r + 1) * edp - 1``.

The universal file of an expert parameter holds all ``num_experts`` rows: ``{"param": [E, ...], "cat_dim": 0,
"is_expert_param": True, "ep_num_experts": E}``; a loader cuts rows ``[ep_rank * E_local, (ep_rank + 1) *
E_local)`` for its own expert-parallel rank (:func:`expert_rows`). DeepSpeed's converter stages each parameter's
per-rank pieces as ``<tmp>/<name>/0/<state>.<dp rank>`` files (:func:`_zero12_fragment_path`); ours streams them
from the rank files (``ds_to_universal``) and uses the same assembly (:func:`assemble_expert_state`).
Every file is written atomically; a malformed checkpoint raises :class:`AutoEPCheckpointError` naming the file or
the parameter and what is wrong.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    AUTOEP_EP_SIZE,
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_NUM_EXPERTS,
    AUTOEP_NUM_LOCAL_EXPERTS,
    AUTOEP_ZERO12_REQUIRED_FIELDS,
    CAT_DIM,
    EP_IS_EXPERT_PARAM,
    EP_NUM_EXPERTS,
    FOLDING_METADATA_KEY,
    PARAM,
)
from deepspeed.checkpoint.folding_metadata import make_folding_metadata, validate_folding_metadata  # noqa: F401
from deepspeed.runtime.checkpointing.atomic import atomic_write, make_dirs

EXPERT_WEIGHT_NAMES = ("w1", "w2", "w3")
ZERO12_STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


class AutoEPCheckpointError(RuntimeError):
    """An AutoEP checkpoint (or its metadata) that cannot be converted or loaded; the message names the file or
    parameter and what is wrong."""


def _save(path: str, obj: Any) -> None:
    atomic_write(path, lambda handle: torch.save(obj, handle))


def _positive_int(value: Any, field: str, prefix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutoEPCheckpointError(f"AutoEP {field} must be a positive integer, got {value!r} (layer {prefix!r}).")
    return value


def get_autoep_zero12_expert_param_info(autoep_layers: Any) -> dict[str, dict[str, int]]:
    """``{"<prefix>.w1|w2|w3": {"num_experts", "num_local_experts", "ep_size"}}`` from a checkpoint's
    ``ds_autoep_layers`` list, checked: every entry a dict with the required fields, counts positive and
    consistent (``num_experts == num_local_experts * ep_size``), no prefix twice."""
    if not isinstance(autoep_layers, list) or not autoep_layers:
        raise AutoEPCheckpointError("AutoEP metadata (ds_autoep_layers) must be a non-empty list for ZeRO-1/2 "
                                    f"universal conversion, got {type(autoep_layers).__name__}.")
    info: dict[str, dict[str, int]] = {}
    for entry in autoep_layers:
        if not isinstance(entry, dict):
            raise AutoEPCheckpointError(f"AutoEP layer metadata must contain dictionaries, got "
                                        f"{type(entry).__name__}.")
        missing = [field for field in AUTOEP_ZERO12_REQUIRED_FIELDS if field not in entry]
        if missing:
            raise AutoEPCheckpointError(f"AutoEP layer metadata is missing fields: {missing} (entry {entry!r}).")
        prefix = entry[AUTOEP_EXPERT_KEY_PREFIX]
        if not isinstance(prefix, str) or not prefix:
            raise AutoEPCheckpointError(f"AutoEP expert_key_prefix must be a non-empty string, got {prefix!r}.")
        counts = {field: _positive_int(entry[field], field, prefix)
                  for field in (AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS, AUTOEP_EP_SIZE)}
        if counts[AUTOEP_NUM_EXPERTS] != counts[AUTOEP_NUM_LOCAL_EXPERTS] * counts[AUTOEP_EP_SIZE]:
            raise AutoEPCheckpointError(
                f"AutoEP expert count mismatch for {prefix}: num_experts={counts[AUTOEP_NUM_EXPERTS]}, "
                f"num_local_experts={counts[AUTOEP_NUM_LOCAL_EXPERTS]}, ep_size={counts[AUTOEP_EP_SIZE]}.")
        for weight in EXPERT_WEIGHT_NAMES:
            name = f"{prefix}.{weight}"
            if name in info:
                raise AutoEPCheckpointError(f"Duplicate AutoEP expert parameter metadata for {name}.")
            info[name] = dict(counts)
    return info


def autoep_zero12_dp_ranks(ep_rank: int, dp_degree: int, ep_size: int, data_first: bool) -> range:
    """The data-parallel ranks (in expert-data-parallel order) whose ZeRO-1/2 files hold ``ep_rank``'s experts."""
    if dp_degree % ep_size:
        raise AutoEPCheckpointError(f"ZeRO data-parallel degree {dp_degree} is not divisible by AutoEP size {ep_size}.")
    if data_first:
        edp = dp_degree // ep_size
        return range(ep_rank * edp, (ep_rank + 1) * edp)
    return range(ep_rank, dp_degree, ep_size)


def _zero12_fragment_path(temp_dir: str, param_name: str, state_name: str, dp_rank: int) -> str:
    """DeepSpeed's staging file of one data-parallel rank's piece of a parameter's state (tensor-parallel rank 0)."""
    return os.path.join(temp_dir, param_name, "0", f"{state_name}.{dp_rank:02d}")


def assemble_expert_state(param_name: str, state_name: str, fragments: Mapping[int, torch.Tensor],
                          local_shape: Sequence[int], meta: Mapping[str, int], dp_degree: int,
                          data_first: bool) -> torch.Tensor:
    """All ``num_experts`` rows of one expert parameter's state from the ranks' pieces (``{dp rank: flat fp32}``;
    ranks holding no piece are absent): each expert-parallel rank's pieces in order make its ``local_shape``
    tensor, and the expert-parallel ranks follow one another along dim 0."""
    ep_size, num_local = meta["ep_size"], meta["num_local_experts"]
    local_shape = tuple(int(s) for s in local_shape)
    if not local_shape or local_shape[0] != num_local:
        raise AutoEPCheckpointError(f"AutoEP local shape mismatch for {param_name}: shape={local_shape}, "
                                    f"num_local_experts={num_local}.")
    expected = int(torch.Size(local_shape).numel())
    rows = []
    for ep_rank in range(ep_size):
        pieces = [fragments[d] for d in autoep_zero12_dp_ranks(ep_rank, dp_degree, ep_size, data_first)
                  if d in fragments]
        if not pieces:
            raise AutoEPCheckpointError(f"Missing AutoEP {state_name} fragments for {param_name}, EP rank {ep_rank}.")
        local = torch.cat([p.reshape(-1) for p in pieces])
        if local.numel() != expected:
            raise AutoEPCheckpointError(f"AutoEP {state_name} fragment size mismatch for {param_name}, EP rank "
                                        f"{ep_rank}: got {local.numel()} values, expected {expected}.")
        rows.append(local.reshape(local_shape))
    full = torch.cat(rows)
    if full.shape[0] != meta["num_experts"]:
        raise AutoEPCheckpointError(f"AutoEP consolidated expert count mismatch for {param_name}: got "
                                    f"{full.shape[0]}, expected {meta['num_experts']}.")
    return full


def expert_universal_state(full: torch.Tensor, num_experts: int) -> dict[str, Any]:
    """The universal file object of an expert parameter's state."""
    return {PARAM: full, CAT_DIM: 0, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts}


def _read_fragment(path: str, state_name: str) -> torch.Tensor:
    try:
        fragment = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported with the file's name
        raise AutoEPCheckpointError(f"{path}: cannot be read as a tensor file ({type(exc).__name__}: {exc})") from None
    if not isinstance(fragment, torch.Tensor):
        raise AutoEPCheckpointError(f"AutoEP {state_name} fragment is not a tensor: {path}")
    if fragment.dtype != torch.float32:
        raise AutoEPCheckpointError(f"AutoEP {state_name} fragment must be FP32, got {fragment.dtype} in {path}.")
    return fragment


def consolidate_autoep_zero12_expert_states(temp_dir: str, output_dir: str,
                                            expert_param_info: Mapping[str, Mapping[str, int]],
                                            slice_shapes: Mapping[str, Sequence[int]], dp_degree: int,
                                            tp_degree: int, use_data_before_expert_parallel: bool) -> None:
    """Write ``<output>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` of every expert parameter from the staged
    per-rank pieces in ``temp_dir`` (DeepSpeed's converter layout). ``slice_shapes``: each parameter's shape on one
    expert-parallel rank. The ranks' ``step`` values must agree."""
    if tp_degree != 1:
        raise NotImplementedError("ZeRO-1/2 universal checkpoint conversion of AutoEP with tensor parallelism "
                                  f"(tp_degree={tp_degree}) is not supported; AutoEP is refused with AutoTP.")
    for name, meta in expert_param_info.items():
        if name not in slice_shapes:
            raise AutoEPCheckpointError(f"AutoEP expert parameter {name} is missing from the checkpoint's "
                                        "parameter shapes (param_shapes).")
        folder = os.path.join(output_dir, "zero", name)
        make_dirs(folder)
        for state_name in ZERO12_STATE_KEYS:
            fragments = {}
            for d in range(dp_degree):
                path = _zero12_fragment_path(temp_dir, name, state_name, d)
                if os.path.isfile(path):
                    fragments[d] = _read_fragment(path, state_name)
            full = assemble_expert_state(name, state_name, fragments, slice_shapes[name], meta, dp_degree,
                                         use_data_before_expert_parallel)
            _save(os.path.join(folder, f"{state_name}.pt"), expert_universal_state(full, meta["num_experts"]))
        steps = [torch.load(p, map_location="cpu", weights_only=True)
                 for p in (_zero12_fragment_path(temp_dir, name, "step", d) for d in range(dp_degree))
                 if os.path.isfile(p)]
        if not steps:
            raise AutoEPCheckpointError(f"Missing AutoEP optimizer step for {name} in {temp_dir}.")
        if any(not _same(steps[0], s) for s in steps[1:]):
            raise AutoEPCheckpointError(f"Inconsistent AutoEP optimizer steps for {name}: {steps}.")
        _save(os.path.join(folder, "step.pt"), steps[0])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def resolve_expert_ckpt_path(checkpoint_dir: str, moe_layer_id: int, global_expert_id: int) -> str:
    """The one ``layer_<l>_expert_<e>_mp_rank_*_model_states.pt`` file of an expert."""
    pattern = os.path.join(checkpoint_dir, f"layer_{moe_layer_id}_expert_{global_expert_id}_mp_rank_*_model_states.pt")
    matches = sorted(glob.glob(pattern))
    if not matches:
        raise FileNotFoundError(f"Expert checkpoint file not found: layer_{moe_layer_id} expert_{global_expert_id} "
                                f"in {checkpoint_dir}")
    if len(matches) > 1:
        _reject_folded_shards(matches)
        raise NotImplementedError(f"Multiple expert checkpoint files found for layer_{moe_layer_id} "
                                  f"expert_{global_expert_id}: {matches}; expert files of several model-parallel "
                                  "ranks are not supported.")
    return matches[0]


def _reject_folded_shards(paths: list[str]) -> None:
    for path in paths:
        folding = torch.load(path, map_location="cpu", weights_only=True).get(FOLDING_METADATA_KEY)
        if isinstance(folding, Mapping) and int(folding.get("tp_size", 1)) > 1:
            raise NotImplementedError(f"Universal conversion of folded AutoEP+AutoTP expert shards (tp_size="
                                      f"{folding['tp_size']}) is not supported: {paths} hold one expert under "
                                      "several tensor-parallel ranks; load the checkpoint with the same folded "
                                      "layout instead")


def consolidate_autoep_expert_files(checkpoint_dir: str, output_dir: str, autoep_layers: Any) -> None:
    """``<output>/zero/<prefix>.wN/fp32.pt`` of every AutoEP layer from its per-expert weight files (each holding
    ``<prefix>.wN.<global expert id>``), stacked in expert order."""
    if not isinstance(autoep_layers, list):
        raise AutoEPCheckpointError(f"AutoEP metadata (ds_autoep_layers) is missing or malformed in {checkpoint_dir}: "
                                    f"expected a list, got {type(autoep_layers).__name__}")
    for entry in autoep_layers:
        prefix, num_experts = entry[AUTOEP_EXPERT_KEY_PREFIX], entry[AUTOEP_NUM_EXPERTS]
        files = [resolve_expert_ckpt_path(checkpoint_dir, entry["moe_layer_id"], e) for e in range(num_experts)]
        states = [torch.load(path, map_location="cpu", weights_only=True) for path in files]
        for weight in EXPERT_WEIGHT_NAMES:
            rows = []
            for e, (path, state) in enumerate(zip(files, states, strict=True)):
                key = f"{prefix}.{weight}.{e}"
                if key not in state:
                    raise AutoEPCheckpointError(f"{path}: expected key {key!r} is missing")
                rows.append(state[key])
            folder = os.path.join(output_dir, "zero", f"{prefix}.{weight}")
            make_dirs(folder)
            _save(os.path.join(folder, "fp32.pt"), expert_universal_state(torch.stack(rows), num_experts))


def expert_rows(full: torch.Tensor, ep_rank: int, ep_size: int, where: str) -> torch.Tensor:
    """Rows of expert-parallel rank ``ep_rank`` (of ``ep_size``) of a universal expert tensor ``full``."""
    if full.shape[0] % ep_size:
        raise AutoEPCheckpointError(f"{where}: {full.shape[0]} experts cannot be split over autoep_size {ep_size}")
    local = full.shape[0] // ep_size
    return full[ep_rank * local:(ep_rank + 1) * local]
