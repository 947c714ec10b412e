"""The ZeRO-3 optimizer state dict (DeepSpeed's stage-3 keys) and restoring it, also onto another world size.

Each rank saves its flat fp32 master partition per group (``fp32_flat_groups``: every parameter's
``ceil(numel / W)``-element slice back to back, in the group's order), the wrapped optimizer's state dict over
those flats (``optimizer_state_dict``), the loss scaler, and ``zero_layout`` (per group: parameter names and
element counts). With the layouts, any saved world size can be loaded: each parameter's whole value is put
together from every saved rank's slice and cut again for this rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_zero.optimizer_state import _load_in_place, loss_scaler_description
from ds_zero.zero3.param import partition_numel

FP32_GROUPS = "fp32_flat_groups"
BASE_STATE = "optimizer_state_dict"
PARTITION_GROUPS = "ds_zero_partition_groups"  # sub-groups over another group than the data-parallel one


def stage3_state_dict(opt: Any) -> dict[str, Any]:
    scaler = opt.loss_scaler
    return {
        "loss_scaler": loss_scaler_description(scaler),  # DeepSpeed's ZeRO-3 load requires the key
        "zero_stage": 3,
        "dynamic_loss_scale": bool(scaler is not None and hasattr(scaler, "scale_window")),
        "overflow": bool(opt.overflow),
        "partition_count": opt.world,
        BASE_STATE: opt.optimizer.state_dict(),
        FP32_GROUPS: [g.master.detach() for g in opt.groups],
        "zero_layout": [{"names": list(g.names), "numels": [int(p.ds_numel) for p in g.params]}
                        for g in opt.groups],
        **({PARTITION_GROUPS: groups} if (groups := opt._zero3_partition_group_metadata()) else {}),
    }


def _check(opt: Any, states: Sequence[dict[str, Any]]) -> None:
    for i, sd in enumerate(states):
        if not isinstance(sd, dict) or FP32_GROUPS not in sd or BASE_STATE not in sd:
            keys = sorted(sd)[:10] if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"ZeRO-3 optimizer state {i} is not a ZeRO stage 3 state (no '{FP32_GROUPS}'/"
                             f"'{BASE_STATE}'; found {keys})")


def _saved_layout(states: Sequence[dict[str, Any]], g: int, opt: Any) -> tuple[list[str], list[int]]:
    layout = states[0].get("zero_layout")
    if layout is None:  # DeepSpeed's own file: the group order is the model's (param_shapes)
        group = opt.groups[g]
        return list(group.names), [int(p.ds_numel) for p in group.params]
    return list(layout[g]["names"]), [int(n) for n in layout[g]["numels"]]


def _whole_values(flats: list[torch.Tensor], names: list[str], numels: list[int]) -> dict[str, torch.Tensor]:
    """name -> whole flattened value, from every saved rank's flat partition (rank order)."""
    world = len(flats)
    out, offset = {}, 0
    for name, numel in zip(names, numels, strict=True):
        part = partition_numel(numel, world)
        pieces = [f.reshape(-1).narrow(0, offset, part) for f in flats]
        out[name] = torch.cat(pieces)[:numel]
        offset += part
    return out


def _cut(opt: Any, g: int, whole: dict[str, torch.Tensor], what: str) -> torch.Tensor:
    group = opt.groups[g]
    missing = [n for n in group.names if n not in whole]
    if missing:
        raise ValueError(f"ZeRO-3 {what}: parameters {missing[:5]} of the model are not in the checkpoint")
    out = torch.zeros(group.numel, dtype=torch.float32)
    for name, p, offset in zip(group.names, group.params, group.offsets, strict=True):
        value = whole[name]
        if value.numel() != p.ds_numel:
            raise ValueError(f"ZeRO-3 {what}: parameter {name} has {value.numel()} elements in the checkpoint and "
                             f"{p.ds_numel} (shape {tuple(p.ds_shape)}) in the model")
        part = p.ds_tensor.numel()
        start = min(p.ds_space.rank * part, p.ds_numel)  # its own partition group's rank (AutoEP experts)
        end = min(start + part, p.ds_numel)
        out[offset:offset + end - start] = value[start:end].float()
    return out


def _same_layout(opt: Any, states: Sequence[dict[str, Any]]) -> bool:
    if len(states) != 1 or states[0].get("partition_count", opt.world) != opt.world:
        return False
    if len(states[0][FP32_GROUPS]) != len(opt.groups):  # other sub-group bounds
        return False
    layout = states[0].get("zero_layout")
    return layout is None or [list(e["names"]) for e in layout] == [list(g.names) for g in opt.groups]


def load_stage3_state(opt: Any, states: Sequence[dict[str, Any]]) -> None:
    _check(opt, states)
    saved_groups = states[0].get(PARTITION_GROUPS)
    # several files: another world size, where expert partitions cannot be put together by name (and states[0] is
    # rank 0's file, whose metadata names rank 0's groups)
    if saved_groups is not None and (len(states) > 1 or saved_groups != opt._zero3_partition_group_metadata()):
        raise ValueError(f"ZeRO-3 optimizer state: its partition groups ({PARTITION_GROUPS}: sub-groups over AutoEP "
                         "expert-data-parallel groups) differ from this optimizer's; it loads onto the same world size "
                         "and autoep_size only (convert it with ds_to_universal.py to change either)")
    first = states[0]
    with_state = getattr(opt, "restore_optimizer_state", True)  # False: the weights alone (load_module_only)
    if with_state and opt.loss_scaler is not None and first.get("loss_scaler"):
        opt.loss_scaler.load_state_dict({**opt.loss_scaler.state_dict(), **first["loss_scaler"]})
    if _same_layout(opt, states):
        masters = [m.reshape(-1) for m in first[FP32_GROUPS]]
        for g, (group, m) in enumerate(zip(opt.groups, masters, strict=True)):
            if m.numel() != group.numel:
                raise ValueError(f"ZeRO-3 optimizer state: group {g}'s saved fp32 partition has {m.numel()} elements, "
                                 f"this rank's has {group.numel} (a different model or world size)")
        base = first[BASE_STATE]
    else:
        masters, base = _repartition(opt, states)
    if with_state:
        _load_in_place(opt.optimizer, base)
    with torch.no_grad():
        for group, master in zip(opt.groups, masters, strict=True):
            if opt.settings.load_from_fp32_weights:
                group.master.data.copy_(master)
                _zero_padding(group)  # DeepSpeed leaves its padding slots uninitialised
                group.copy_master_to_lp()
            else:  # as DeepSpeed: the model's current 16-bit weights (loaded some other way) become the masters
                group.sync_master_from_lp()


def _zero_padding(group: Any) -> None:
    flat = group.master.data
    for p, offset in zip(group.params, group.offsets, strict=True):
        part = p.ds_tensor.numel()
        valid = max(0, min(part, p.ds_numel - p.ds_space.rank * part))
        if valid < part:
            flat[offset + valid:offset + part] = 0


def _whole_by_name(states: Sequence[dict[str, Any]], opt: Any, pick: Any) -> dict[str, torch.Tensor]:
    """name -> whole value over every saved sub-group; ``pick(state, g)`` is a saved rank's flat tensor ``g``."""
    whole: dict[str, torch.Tensor] = {}
    for g in range(len(states[0][FP32_GROUPS])):
        names, numels = _saved_layout(states, g, opt)
        whole.update(_whole_values([pick(sd, g) for sd in states], names, numels))
    return whole


def _repartition(opt: Any, states: Sequence[dict[str, Any]]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Cut every saved rank's partitions again for this rank (another world size, or other sub-group bounds):
    each parameter's whole value is put together by name, then this rank's slice is taken."""
    if opt._zero3_partition_group_metadata() is not None:
        raise ValueError("ZeRO-3 optimizer state: AutoEP expert partitions (over each expert-data-parallel group) "
                         "load onto the same world size and autoep_size only; convert the checkpoint with "
                         "ds_to_universal.py and load it with checkpoint.load_universal to change either")
    masters_by_name = _whole_by_name(states, opt, lambda sd, g: sd[FP32_GROUPS][g])
    trained = {n for group in opt.groups for n in group.names}
    extra = [n for n in masters_by_name if n not in trained]
    if extra:
        raise ValueError(f"ZeRO-3 optimizer state: parameters {extra[:5]} of the checkpoint are not trained by this "
                         "optimizer (another model, or other frozen parameters)")
    masters = [_cut(opt, g, masters_by_name, "optimizer state") for g in range(len(opt.groups))]
    saved_state = states[0][BASE_STATE]["state"]
    first = saved_state.get(0, {})
    new_state: dict[int, dict[str, Any]] = {}
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == states[0][FP32_GROUPS][0].numel():
            per_key[key] = _whole_by_name(states, opt, lambda sd, g, key=key: sd[BASE_STATE]["state"][g][key])
    for g in range(len(opt.groups)):
        group_state = {}
        for key, value in first.items():
            if key in per_key:
                group_state[key] = _cut(opt, g, per_key[key], f"optimizer state {key!r}").to(value.dtype)
            else:  # per-group scalars (Adam's step) are the same in every saved sub-group; each new sub-group
                # gets its own copy (optimizers count steps in place)
                group_state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        if group_state:
            new_state[g] = group_state
    current = opt.optimizer.state_dict()["param_groups"]
    saved_groups = states[0][BASE_STATE]["param_groups"]
    if len(saved_groups) != len(current):
        raise ValueError(f"ZeRO-3 optimizer state has {len(saved_groups)} parameter groups; this optimizer has "
                         f"{len(current)}")
    groups = [{**saved, "params": now["params"]} for saved, now in zip(saved_groups, current, strict=True)]
    return masters, {"state": new_state, "param_groups": groups}
