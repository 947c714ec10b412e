"""The ZeRO stage 1/2 optimizer state dict (DeepSpeed's keys) and restoring it, also onto another world size.

Each rank saves its fp32 master partition per group (``single_partition_of_fp32_groups``), the wrapped
optimizer's state dict over those partitions (``base_optimizer_state``: one flat tensor per group, so state
key ``g`` is group ``g``), the loss scaler, and ``zero_layout`` (per group: parameter names and sizes in flat
order and the alignment). With the layouts, every saved rank's partitions can be concatenated into each
group's full flat vector and cut again for any new world size, matching parameters by name.
A group partitioned over its own process group (MoE experts, over the expert-data-parallel group) records that
group's size in ``partition_count`` and its padding on that group's last rank, as DeepSpeed does; such a group is
restored on the same layout only (the saved ranks hold different experts under the same names).

``param_slice_mappings`` (per group: parameter name -> where its piece lies in this rank's fp32 partition) is what
DeepSpeed's universal-checkpoint converter (``ds_to_universal``) cuts each rank's flat state by. It is written here
as plain ``{"numel", "start"}`` dicts; the engine's save turns them into the ``fragment_address`` objects
DeepSpeed pickles there. Our loads never need it (``zero_layout`` says more), so files without it still load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_zero.partition import FlatLayout

FP32_GROUPS = "single_partition_of_fp32_groups"
BASE_STATE = "base_optimizer_state"


UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"


def param_slice_mappings(groups: Sequence[Any]) -> list[dict[str, dict[str, int]]]:
    """Per flat group (``FlatGroup``), in flat order: the name of each parameter with a piece in this rank's
    partition -> ``{"numel": n, "start": s}``, its ``n`` elements from offset ``s`` of the partition (this rank's
    fp32 master and each flat optimizer state). A parameter spanning two ranks has a piece in both files (its
    head on the first, from its ``start`` to the partition's end; its tail on the next, from 0); one wholly on
    other ranks, or with no elements, is left out, as DeepSpeed leaves out parameters without a fragment."""
    return [{fg.names[frag.index]: {"numel": frag.numel, "start": frag.partition_offset} for frag in fg.own}
            for fg in groups]


def universal_checkpoint_info_of(groups: Sequence[Sequence[Any]]) -> Any:
    """The universal-checkpoint description a model parameter carries (``param.universal_checkpoint_info``, the
    merge rules DeepSpeed's AutoTP attaches), the first found in ``groups``; None when none carries one. The
    optimizers read it once at construction, so the state dicts they save keep it whatever happens to the
    parameters later."""
    for group in groups:
        for param in group:
            info = getattr(param, UNIVERSAL_CHECKPOINT_INFO, None)
            if info is not None:
                return info
    return None


def partitioned_state_dict(opt: Any) -> dict[str, Any]:
    """This rank's share of the optimizer state (``opt``: a ``DeepSpeedZeroOptimizer``)."""
    scaler = opt.loss_scaler
    # DeepSpeed's stage 1/2 load keeps its own scaler when the key is absent (no scaling: nothing to restore)
    state = {} if scaler is None else {"loss_scaler": loss_scaler_description(scaler)}
    info = getattr(opt, "_universal_checkpoint_info", None)
    if info is not None:  # DeepSpeed saves the parameters' merge rules with the ZeRO state too
        state[UNIVERSAL_CHECKPOINT_INFO] = info
    return {
        **state,
        "dynamic_loss_scale": bool(scaler is not None and hasattr(scaler, "scale_window")),
        "overflow": bool(opt.overflow),
        "clip_grad": float(opt.settings.clip),
        BASE_STATE: opt.optimizer.state_dict(),
        FP32_GROUPS: [fg.master.detach() for fg in opt.groups],
        "zero_stage": int(opt.settings.stage),
        "group_paddings": [fg.layout.padding if fg.rank == fg.layout.world_size - 1 else 0 for fg in opt.groups],
        "partition_count": [fg.layout.world_size for fg in opt.groups],
        "zero_layout": [{"names": list(fg.names), "numels": list(fg.layout.numels),
                         "alignment": fg.layout.alignment} for fg in opt.groups],
        PARAM_SLICE_MAPPINGS: param_slice_mappings(opt.groups),
    }


def loss_scaler_description(scaler: Any) -> dict[str, Any] | None:
    """The scaler's state and settings as plain values (``None``: no scaling). The engine's save turns it into
    the scaler object DeepSpeed pickles under ``loss_scaler`` (its loaders use that object as their scaler)."""
    if scaler is None:
        return None
    settings = {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
    return {**settings, **scaler.state_dict()}


def _check(opt: Any, states: Sequence[dict[str, Any]]) -> None:
    for i, sd in enumerate(states):
        if not isinstance(sd, dict) or FP32_GROUPS not in sd or BASE_STATE not in sd:
            keys = sorted(sd)[:10] if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"ZeRO optimizer state {i} is not a ZeRO stage 1/2 state (no '{FP32_GROUPS}'/"
                             f"'{BASE_STATE}'; found {keys})")
        if len(sd[FP32_GROUPS]) != len(opt.groups):
            raise ValueError(f"ZeRO optimizer state has {len(sd[FP32_GROUPS])} parameter groups; this optimizer "
                             f"has {len(opt.groups)}")


def load_partitioned_state(opt: Any, states: Sequence[dict[str, Any]], same_layout: bool) -> None:
    """Restore ``opt`` from ``states``: this rank's own state (``same_layout``) or every saved rank's, in rank
    order (re-partitioned for this world size)."""
    _check(opt, states)
    first = states[0]
    if opt.loss_scaler is not None and first.get("loss_scaler"):
        opt.loss_scaler.load_state_dict({**opt.loss_scaler.state_dict(), **first["loss_scaler"]})
    if same_layout:
        if not same_names(first, opt):
            raise ValueError("ZeRO optimizer state: the saved groups hold other parameters or another order (e.g. "
                             "round_robin_gradients or the parameter groups changed); load every rank's state to "
                             "re-partition by name")
        paddings = first.get("group_paddings") or [0] * len(opt.groups)
        first = {**first, FP32_GROUPS: [_padded(m, fg.layout.partition_numel, pad)
                                        for m, fg, pad in zip(first[FP32_GROUPS], opt.groups, paddings, strict=True)]}
        for g, (fg, master) in enumerate(zip(opt.groups, first[FP32_GROUPS], strict=True)):
            if master.numel() != fg.layout.partition_numel:
                raise ValueError(f"ZeRO optimizer state: group {g}'s saved fp32 partition has {master.numel()} "
                                 f"elements, this rank's has {fg.layout.partition_numel} (a different model or "
                                 "world size; load every rank's state to re-partition)")
        masters, base = list(first[FP32_GROUPS]), first[BASE_STATE]
    else:
        masters, base = _repartition(opt, states)
    _load_in_place(opt.optimizer, base)
    with torch.no_grad():
        for fg, master in zip(opt.groups, masters, strict=True):
            if opt.settings.load_from_fp32_weights:
                fg.master.data.copy_(master)
                fg.copy_master_to_lp()
            else:  # the module's (already loaded) 16-bit weights are the source of truth
                fg.sync_master_from_lp()


def _load_in_place(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping the live ``param_groups`` list and dicts (torch's load puts
    new ones in their place). Other holders of those dicts must go on driving this optimizer: Accelerate builds
    the offload ``DeepSpeedCPUAdam`` over the client torch optimizer's groups, and the client's LR schedule,
    built on that torch optimizer, writes the lr into them. The saved tensors are copied into the live state
    tensors (:func:`_into_live_state`), so none of them is kept."""
    live = optimizer.param_groups
    kept = list(live)
    optimizer.load_state_dict(_into_live_state(optimizer, state))
    for old, new in zip(kept, optimizer.param_groups, strict=True):
        old.update(new)  # the same "params"; the saved lr, betas, ... and any extra keys
    optimizer.param_groups = live


def _into_live_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each saved tensor copied into the optimizer's current tensor of the same parameter and key
    when it has the same shape and dtype (memory already in use: no allocation, no page faults), else cloned.

    Why: the checkpoint reader maps the files (``load.mapped``), and torch's ``load_state_dict`` keeps the tensors
    it is given; the optimizer must own its state, not hold views of a file that may later be overwritten."""
    saved = state.get("state") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        return state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: dict[Any, Any] = {}
    for index, entry in saved.items():
        if not isinstance(entry, dict):
            out[index] = entry
            continue
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        current = optimizer.state.get(param, {}) if param is not None else {}
        out[index] = {key: _into(current.get(key), value) for key, value in entry.items()}
    return {**state, "state": out}


def _into(live: Any, value: Any) -> Any:
    if not torch.is_tensor(value):
        return value
    if live is value:
        return live
    if torch.is_tensor(live) and live.shape == value.shape and live.dtype == value.dtype and not live.requires_grad:
        with torch.no_grad():
            live.copy_(value)
        return live
    return value.detach().clone()


def same_names(state: dict[str, Any], opt: Any) -> bool:
    """Do the saved groups hold the same parameters in the same flat order as ``opt``'s? (States without
    ``zero_layout``, DeepSpeed's own, are taken to match: their order is the model's.)"""
    layout = state.get("zero_layout")
    if layout is None:
        return True
    return [list(entry["names"]) for entry in layout] == [list(fg.names) for fg in opt.groups]


def _padded(master: torch.Tensor, numel: int, padding: int) -> torch.Tensor:
    """DeepSpeed saves the last rank's fp32 partition without its padding (``group_paddings``): restore it."""
    if padding and master.numel() == numel - padding:
        return torch.cat([master.reshape(-1), master.new_zeros(padding)])
    return master


def _old_layout(states: Sequence[dict[str, Any]], g: int) -> tuple[FlatLayout, list[str]]:
    info = states[0].get("zero_layout")
    if info is None:
        raise ValueError("ZeRO optimizer state has no 'zero_layout' (parameter names per group), so it cannot be "
                         "re-partitioned for a different world size; load it with the world size it was saved with")
    entry = info[g]
    return FlatLayout(entry["numels"], len(states), entry["alignment"]), list(entry["names"])


def _remap(fg: Any, full: torch.Tensor, old: FlatLayout, old_names: list[str], g: int) -> torch.Tensor:
    """This rank's new partition, cut from the old full flat vector ``full`` by parameter name."""
    where = {name: (old.offsets[i], old.numels[i]) for i, name in enumerate(old_names)}
    missing = [n for n in fg.names if n not in where]
    current = set(fg.names)
    extra = [n for n in old_names if n not in current]
    if missing or extra:
        raise ValueError(f"ZeRO optimizer state, group {g}: parameters {missing[:5]} are not in the checkpoint and "
                         f"{extra[:5]} of the checkpoint are not in the model")
    out = torch.zeros(fg.layout.partition_numel, dtype=full.dtype)
    for frag in fg.own:
        offset, numel = where[fg.names[frag.index]]
        if numel != fg.layout.numels[frag.index]:
            raise ValueError(f"ZeRO optimizer state: parameter {fg.names[frag.index]} has {numel} elements in the "
                             f"checkpoint and {fg.layout.numels[frag.index]} in the model")
        out[frag.partition_offset:frag.partition_offset + frag.numel] = \
            full[offset + frag.tensor_offset:offset + frag.tensor_offset + frag.numel]
    return out


def _check_repartitionable(opt: Any, states: Sequence[dict[str, Any]]) -> None:
    """Only groups partitioned over the whole data-parallel group, then and now, can be cut from every rank's
    partitions (a MoE expert group's ranks hold different experts under the same parameter names)."""
    counts = states[0].get("partition_count")
    saved = counts if isinstance(counts, list) else [len(states)] * len(opt.groups)
    for g, fg in enumerate(opt.groups):
        if saved[g] != len(states) or fg.layout.world_size != getattr(opt, "world", fg.layout.world_size):
            raise ValueError(f"ZeRO optimizer state, group {g}: partitioned over {saved[g]} of the {len(states)} "
                             f"saved ranks (now {fg.layout.world_size} of {opt.world}), e.g. a MoE expert group; such "
                             "a group is restored only onto the layout it was saved with (same data-parallel and "
                             "expert-parallel sizes, same parameter groups)")


def _repartition(opt: Any, states: Sequence[dict[str, Any]]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    _check_repartitionable(opt, states)
    masters = []
    new_state: dict[int, dict[str, Any]] = {}
    for g, fg in enumerate(opt.groups):
        old, names = _old_layout(states, g)
        full = torch.cat([sd[FP32_GROUPS][g].reshape(-1).float() for sd in states])
        masters.append(_remap(fg, full, old, names, g))
        group_state = {}
        for key, value in states[0][BASE_STATE]["state"].get(g, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == old.partition_numel and value.dim() == 1:
                full_state = torch.cat([sd[BASE_STATE]["state"][g][key].reshape(-1) for sd in states])
                group_state[key] = _remap(fg, full_state, old, names, g)
            else:
                group_state[key] = value
        if group_state:
            new_state[g] = group_state
    base = {"state": new_state, "param_groups": states[0][BASE_STATE]["param_groups"]}
    return masters, base
