"""ZeRO stage 1/2 files in a training checkpoint (a ``CheckpointShards`` extension of the engine's checkpointing).

Every data-parallel rank writes ``zero_pp_rank_<r>_mp_rank_XX_optim_states.pt`` = ``{"optimizer_state_dict":
<its partitioned optimizer state>, "ds_config": ..., "ds_version": ...}`` and the model-states file gets
DeepSpeed's ``param_shapes`` / ``frozen_param_shapes`` / ``frozen_param_fragments`` / ``shared_params``, which
is what ``zero_to_fp32`` reads. Rank 0 also copies the standalone ``zero_to_fp32.py`` script into the save
folder (beside ``latest``). Loading onto the saved world size reads this rank's file; onto another one,
every saved rank's file, and the partitions are cut again (see ``optimizer_state``).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_config import DeepSpeedConfig
from ds_zero.optimizer_state import same_names
from ds_zero.partition import nccl_alignment

OPTIMIZER_STATE_DICT = "optimizer_state_dict"


def saved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (the engine's resolved config dict) as checkpoint files store it under ``ds_config``: only the values
    that differ from ``ds_config``'s defaults, as DeepSpeed stores the dict the user passed rather than every
    default (a few hundred bytes instead of ~9 KB in each file). Validating it again gives the same config; a
    null under a key with no default entry (an unset option of a typed section) is left out too."""
    return _non_default(dict(config), _default_config())


@functools.cache
def _default_config() -> dict[str, Any]:
    return DeepSpeedConfig().to_dict()


def _non_default(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        default = defaults.get(key)  # None also where the key has no default entry
        if isinstance(value, dict):
            inner = _non_default(value, default if isinstance(default, dict) else {})
            if inner or not isinstance(default, dict):  # an empty section present where none is by default: kept
                out[key] = inner
        elif value != default:
            out[key] = value
    return out


def optim_states_name(dp_rank: int, mp_rank: int = 0, prefix: str = "") -> str:
    """DeepSpeed's name; ``prefix`` is ``"bf16_"`` when bf16 is enabled (DeepSpeed names those files so)."""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _plain_loss_scaler(value: Any) -> dict[str, Any] | None:
    """DeepSpeed pickles its loss-scaler object; read back with placeholders, its attributes are the state."""
    if value is None or isinstance(value, dict):
        return value
    state = getattr(value, "state", None)
    if state is None and hasattr(value, "cur_scale"):  # an object built (an allowlisted class), not a placeholder
        state = vars(value)
    if isinstance(state, dict):
        keys = ("cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")
        return {k: state[k] for k in keys if k in state}
    return None


def _plain_state(sd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state with DeepSpeed's pickled objects (``ZeroStageEnum``, the loss scaler, fragment
    addresses) turned into plain values."""
    sd = dict(sd)
    if "zero_stage" in sd and not isinstance(sd["zero_stage"], int):
        sd["zero_stage"] = int(sd["zero_stage"])
    if "loss_scaler" in sd:
        sd["loss_scaler"] = _plain_loss_scaler(sd["loss_scaler"])
    sd.pop("param_slice_mappings", None)
    return sd


def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: every name after the first -> the first name of the same tensor."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


class ZeroCheckpointShards:
    """The engine's checkpoint extension for a ``DeepSpeedZeroOptimizer`` (``owns_optimizer_state``)."""

    owns_optimizer_state = True

    def __init__(self, optimizer: Any, module: torch.nn.Module, ds_config: Mapping[str, Any],
                 ds_version: str, bf16: bool = False) -> None:
        self.optimizer = optimizer
        self.module = module
        self.ds_config = saved_config(ds_config)
        self.ds_version = ds_version
        self.prefix = "bf16_" if bf16 else ""

    def model_state_extras(self) -> Mapping[str, Any]:
        frozen = {name: p for name, p in self.module.named_parameters() if not p.requires_grad}
        return {
            "param_shapes": [OrderedDict((name, p.shape) for name, p in zip(fg.names, fg.params, strict=True))
                             for fg in self.optimizer.groups],
            "frozen_param_shapes": {name: p.shape for name, p in frozen.items()} or None,
            "frozen_param_fragments": {name: p.detach().clone() for name, p in frozen.items()} or None,
            "shared_params": shared_params(self.module),
        }

    def files_to_save(self, ctx: Any) -> Mapping[str, Any]:
        name = optim_states_name(ctx.parallel.dp_rank, ctx.parallel.mp_rank, self.prefix)
        state = {**self.optimizer.state_dict(), "ds_version": self.ds_version}  # DeepSpeed's load asserts it
        return {name: {OPTIMIZER_STATE_DICT: state, "ds_config": self.ds_config, "ds_version": self.ds_version}}

    def files_to_copy(self, ctx: Any) -> Mapping[str, str]:
        """``{name in the save dir: source file}`` copied by the first rank: the ``zero_to_fp32.py`` script, next
        to ``latest`` as DeepSpeed places it (``cd <save_dir>; python zero_to_fp32.py . out/``)."""
        if ctx.parallel.global_rank != 0:
            return {}
        from ds_zero import zero_to_fp32

        return {"zero_to_fp32.py": os.path.abspath(zero_to_fp32.__file__)}

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_load(ctx, load)()

    def prepare_load(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        """Read and check the optimizer files this rank needs, changing nothing and entering no collective; returns
        the step that restores them (``optimizer.load_state_dict``, which all-gathers the weights). The engine's
        loader runs every rank's reads, agrees that all succeeded, and only then the steps."""
        if ctx.load_module_only or not ctx.load_optimizer_states:
            return lambda: None
        state = self._read_optimizer_files(ctx, load)
        return lambda: self.optimizer.load_state_dict(state)

    def _read_optimizer_files(self, ctx: Any, load: Callable[[str], Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """This rank's saved state (same world size and layout), else every saved rank's, in rank order."""
        mp_rank, rank = ctx.parallel.mp_rank, ctx.parallel.dp_rank
        prefix = self._saved_prefix(ctx, mp_rank)
        # this rank's own file when it exists (the usual, same-world case reads nothing else), else rank 0's
        probe = optim_states_name(rank, mp_rank, prefix)
        if not os.path.isfile(os.path.join(ctx.tag_dir, probe)):
            probe = optim_states_name(0, mp_rank, prefix)
        first = self._read(ctx, load, probe)
        counts = first.get("partition_count", 1)
        saved_world = max(counts) if isinstance(counts, list) else int(counts)
        if (saved_world > ctx.parallel.dp_world_size and probe == optim_states_name(rank, mp_rank, prefix)
                and counts == [getattr(fg.layout, "world_size", None) for fg in self.optimizer.groups]
                and same_names(first, self.optimizer)):
            # AutoEP folded onto AutoTP with tp > ep: an expert group spans more ranks than the data-parallel
            # group that names the files; same layout, so this rank's own file is all it needs
            self._check_states(ctx, [probe], [first], same_layout=True)
            return first
        names = [optim_states_name(r, mp_rank, prefix) for r in range(saved_world)]
        missing = [n for n in names if not os.path.isfile(os.path.join(ctx.tag_dir, n))]
        if missing:
            raise file_error(ctx.tag_dir, missing[0], f"missing: saved by {saved_world} data-parallel ranks but "
                             f"{missing} are absent, the checkpoint is incomplete (load another tag)")
        if saved_world == ctx.parallel.dp_world_size and same_names(first, self.optimizer):
            self._check_states(ctx, [probe], [first], same_layout=True)
            return first  # probe is this rank's file: it exists when none is missing
        states = [first if n == probe else self._read(ctx, load, n) for n in names]
        self._check_states(ctx, names, states, same_layout=False)
        if "zero_layout" not in states[0]:  # written by DeepSpeed: the flat order is the model file's param_shapes
            states[0]["zero_layout"] = self._layout_from_param_shapes(ctx, load, saved_world)
        return states

    def _check_states(self, ctx: Any, names: list[str], states: list[dict[str, Any]], same_layout: bool) -> None:
        """Before anything changes: each saved state has ZeRO's keys and this optimizer's number of groups, and
        (same layout) each fp32 partition and optimizer-state tensor has this rank's partition size."""
        from ds_zero.optimizer_state import BASE_STATE, FP32_GROUPS, _check

        opt = self.optimizer
        for name, sd in zip(names, states, strict=True):
            try:
                _check(opt, [sd])
            except ValueError as exc:
                raise file_error(ctx.tag_dir, name, str(exc)) from None
        if not same_layout:
            return
        sd = states[0]
        paddings = sd.get("group_paddings") or [0] * len(opt.groups)
        base = sd[BASE_STATE].get("state", {}) if isinstance(sd[BASE_STATE], dict) else {}
        for g, (fg, master) in enumerate(zip(opt.groups, sd[FP32_GROUPS], strict=True)):
            sizes = (fg.layout.partition_numel, fg.layout.partition_numel - paddings[g])
            tensors = {FP32_GROUPS: master, **per_element_states(opt, g, master, base.get(g, {}), sizes, BASE_STATE)}
            check_partition_sizes(ctx.tag_dir, names[0], g, tensors, sizes)

    def load_universal(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_universal(ctx, load)()

    def prepare_universal(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        """Restore from a Universal Checkpoint folder (``ctx.tag_dir``, DeepSpeed's ``ds_to_universal`` layout): this
        rank reads only the ``zero/<name>/*.pt`` files of the parameters its partitions hold, and only its slices
        are kept. The fp32 values always load (as DeepSpeed's universal load); Adam's states when asked. Reads and
        checks now (no collective); the returned step applies and all-gathers."""
        opt = self.optimizer
        check_universal_folders(ctx.tag_dir, [name for fg in opt.groups for name in fg.names])
        with_state = ctx.load_optimizer_states and not ctx.load_module_only
        common = read_universal_common(ctx, load) if with_state else {}
        masters, new_state = [], {}
        for g, fg in enumerate(opt.groups):
            lo, hi = fg.layout.partition_range(fg.rank)
            keys = universal_keys(ctx.tag_dir, fg.names, with_state)
            flats = {key: torch.zeros(fg.layout.partition_numel, dtype=torch.float32) for key in keys}
            for name, param, offset, numel in zip(fg.names, fg.params, fg.layout.offsets, fg.layout.numels,
                                                  strict=True):
                start, end = max(lo, offset), min(hi, offset + numel)
                if start >= end:
                    continue  # another rank's parameter: its files are not read
                for key, flat in flats.items():
                    value = read_universal(ctx, load, name, key, numel, getattr(param, EXPERT_ROWS_ATTR, None))
                    flat[start - lo:end - lo] = value[start - offset:end - offset]
            masters.append(flats.pop("fp32"))
            if flats:
                new_state[g] = {**universal_step(ctx, load, fg.names, common, g), **flats}
        if with_state:
            check_universal_groups(opt, common)

        def apply() -> None:
            if with_state:
                restore_universal_common(opt, new_state, common)
            with torch.no_grad():
                for fg, master in zip(opt.groups, masters, strict=True):
                    fg.master.data.copy_(master)
                    fg.copy_master_to_lp()
            opt.all_gather_params()

        return apply

    def _saved_prefix(self, ctx: Any, mp_rank: int) -> str:
        """This engine's file prefix, else the other one (a bf16 checkpoint loaded without bf16, or vice versa)."""
        for prefix in (self.prefix, "bf16_" if not self.prefix else ""):
            if os.path.isfile(os.path.join(ctx.tag_dir, optim_states_name(0, mp_rank, prefix))):
                return prefix
        return self.prefix  # missing: the read names the expected file

    @staticmethod
    def _read(ctx: Any, load: Callable[[str], Any], name: str) -> dict[str, Any]:
        """One optimizer-states file; DeepSpeed's own files pickle a few of its classes, which a weights-only
        load refuses: those are read as inert placeholders (no code from the file runs) and made plain."""
        try:
            # mapped: the tensors are copied into the live partitions and optimizer state when applied
            obj = getattr(load, "mapped", load)(name)
        except Exception as exc:
            if type(exc).__name__ != "UnsafeCheckpointError":
                raise
            from ds_zero.zero_to_fp32 import load_checkpoint_file as load_with_placeholders

            obj = load_with_placeholders(os.path.join(ctx.tag_dir, name))
        return _plain_state(_optimizer_state(obj, name, ctx.tag_dir))

    def _layout_from_param_shapes(self, ctx: Any, load: Callable[[str], Any], saved_world: int) -> list[dict]:
        name = f"mp_rank_{ctx.parallel.mp_rank:02d}_model_states.pt"
        shapes = getattr(load, "mapped", load)(name).get("param_shapes")  # the engine's read of it, reused
        if not shapes:
            raise ValueError(f"{name} has no 'param_shapes', so the ZeRO partitions of {ctx.tag_dir} cannot be cut "
                             f"for {ctx.parallel.dp_world_size} ranks; load it on {saved_world}")
        return [{"names": list(group), "numels": [int(torch.Size(s).numel()) for s in group.values()],
                 "alignment": nccl_alignment(saved_world)} for group in shapes]


def per_element_states(opt: Any, g: int, master: Any, saved: Mapping[Any, Any], sizes: tuple[int, ...],
                       label: str) -> dict[str, torch.Tensor]:
    """The saved optimizer states of group ``g`` that hold one value per partition element (Adam's moments), named
    for errors: those with the saved master's size, or that this optimizer keeps so. Others are per group (a client
    optimizer's step counter as a tensor) and need no partition size."""
    try:
        live = opt.optimizer.state.get(opt.optimizer.param_groups[g]["params"][0], {})
    except (AttributeError, IndexError, KeyError, TypeError):
        live = {}
    return {f"{label} {key!r}": value for key, value in saved.items()
            if torch.is_tensor(value) and value.dim() >= 1
            and (not torch.is_tensor(master) or value.numel() == master.numel()
                 or (torch.is_tensor(live.get(key)) and live[key].numel() in sizes))}


def file_error(tag_dir: str, name: str, reason: str) -> ValueError:
    """A ``ValueError`` about one checkpoint file; ``checkpoint_path`` / ``reason`` let the engine's loader report
    it as ``<file>: <reason>`` on every rank."""
    path = os.path.join(tag_dir, name)
    error = ValueError(f"{path}: {reason}")
    error.checkpoint_path, error.reason = path, reason  # type: ignore[attr-defined]
    return error


def check_partition_sizes(tag_dir: str, name: str, g: int, tensors: Mapping[str, Any], sizes: tuple[int, ...]) -> None:
    """Every tensor of ``tensors`` (what -> value) must have one of ``sizes`` elements (this rank's partition)."""
    for what, value in tensors.items():
        if not torch.is_tensor(value):
            raise file_error(tag_dir, name, f"wrong content: group {g}'s {what} is a {type(value).__name__}, not a "
                             "tensor")
        if value.numel() not in sizes:
            raise file_error(tag_dir, name, f"wrong shape: group {g}'s {what} has {value.numel()} elements "
                             f"(shape {tuple(value.shape)}), this rank's partition has {sizes[0]} (another model, "
                             "world size or parameter grouping)")


def _optimizer_state(obj: Any, name: str, tag_dir: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or OPTIMIZER_STATE_DICT not in obj:
        found = sorted(map(str, obj))[:10] if isinstance(obj, dict) else type(obj).__name__
        raise file_error(tag_dir, name, f"missing key '{OPTIMIZER_STATE_DICT}': not a ZeRO optimizer-states file "
                         f"(found {found})")
    state = obj[OPTIMIZER_STATE_DICT]
    if not isinstance(state, dict):
        raise file_error(tag_dir, name, f"key '{OPTIMIZER_STATE_DICT}' holds a {type(state).__name__}, not a dict")
    return state


# ---- Universal Checkpoint reading (shared with ZeRO-3) ----------------------------------------------------------
UNIVERSAL_ZERO = "zero"
# (ep_rank, ep_size) an AutoEP expert parameter carries: its rows of a universal expert tensor
EXPERT_ROWS_ATTR = "ds_autoep_rank"
UNIVERSAL_OPTIMIZER_STATE = "optimizer_state.pt"


def check_universal_folders(tag_dir: str, names: list[str]) -> None:
    """Every trainable parameter needs ``zero/<name>/fp32.pt``; checked on every rank before anything loads."""
    missing = [n for n in names if not os.path.isfile(os.path.join(tag_dir, UNIVERSAL_ZERO, n, "fp32.pt"))]
    if missing:
        raise FileNotFoundError(f"universal checkpoint {tag_dir}: {len(missing)} of the model's {len(names)} trained "
                                f"parameters have no folder {UNIVERSAL_ZERO}/<name>/ with fp32.pt (first: "
                                f"{[os.path.join(UNIVERSAL_ZERO, n) for n in missing[:5]]}); convert the checkpoint "
                                "of this model again with ds_to_universal")


def universal_keys(tag_dir: str, names: list[str], with_state: bool) -> list[str]:
    """fp32, plus the Adam states the converter wrote (judged by the group's first parameter)."""
    keys = ["fp32"]
    if with_state and names:
        folder = os.path.join(tag_dir, UNIVERSAL_ZERO, names[0])
        keys += [k for k in ("exp_avg", "exp_avg_sq") if os.path.isfile(os.path.join(folder, f"{k}.pt"))]
    return keys


def _read_plain(ctx: Any, load: Callable[[str], Any], name: str) -> Any:
    try:
        return load(name)
    except Exception as exc:  # DeepSpeed's own files may pickle its classes: read as inert placeholders
        if type(exc).__name__ != "UnsafeCheckpointError":
            raise
        from ds_zero.zero_to_fp32 import load_checkpoint_file as load_with_placeholders

        return load_with_placeholders(os.path.join(ctx.tag_dir, name))


def read_universal(ctx: Any, load: Callable[[str], Any], name: str, key: str, numel: int,
                   expert_rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``zero/<name>/<key>.pt`` flattened (``{"param": t}`` at stage 1/2, a bare tensor at stage 3). An expert
    parameter's file (``is_expert_param``) holds every expert's rows: ``expert_rows`` = (ep_rank, ep_size) of the
    parameter (``EXPERT_ROWS_ATTR``) picks this expert-parallel rank's share of them."""
    rel = os.path.join(UNIVERSAL_ZERO, name, f"{key}.pt")
    obj = _read_plain(ctx, load, rel)
    value = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(value, torch.Tensor):
        raise file_error(ctx.tag_dir, rel, f"holds no tensor (found {type(obj).__name__})")
    if isinstance(obj, dict) and obj.get("is_expert_param") and expert_rows is not None:
        ep_rank, ep_size = expert_rows
        if value.dim() == 0 or value.shape[0] % ep_size:
            raise file_error(ctx.tag_dir, rel, f"{value.shape[0] if value.dim() else 0} experts cannot be split over "
                             f"autoep_size {ep_size} (parameter {name!r})")
        local = value.shape[0] // ep_size
        value = value[ep_rank * local:(ep_rank + 1) * local]
    value = value.detach().reshape(-1)
    if value.numel() != numel:
        raise file_error(ctx.tag_dir, rel, f"wrong shape: {value.numel()} values, the model's parameter {name!r} "
                         f"has {numel}")
    return value.float()


def read_universal_common(ctx: Any, load: Callable[[str], Any]) -> dict[str, Any]:
    rel = os.path.join(UNIVERSAL_ZERO, UNIVERSAL_OPTIMIZER_STATE)
    if not os.path.isfile(os.path.join(ctx.tag_dir, rel)):
        return {}
    return _plain_state(_read_plain(ctx, load, rel))


def universal_step(ctx: Any, load: Callable[[str], Any], names: list[str], common: dict[str, Any],
                   g: int) -> dict[str, Any]:
    """``{"step": value}`` from the group's first ``step.pt``, else the saved param group's ``step``, else the step
    of the saving rank's own optimizer state kept in ``optimizer_state.pt`` (DeepSpeed's converter writes no
    ``step.pt`` at stage 3: its stage-3 load takes state 0's step for every group), else {}."""
    rel = os.path.join(UNIVERSAL_ZERO, names[0], "step.pt") if names else ""
    if rel and os.path.isfile(os.path.join(ctx.tag_dir, rel)):
        return {"step": _read_plain(ctx, load, rel)}
    groups = common.get("param_groups") or []
    if g < len(groups) and "step" in groups[g]:
        return {"step": groups[g]["step"]}
    inner = common.get("optimizer_state_dict")
    states = inner.get("state") if isinstance(inner, dict) else None
    if isinstance(states, dict):
        for key in (g, 0):
            if isinstance(states.get(key), dict) and "step" in states[key]:
                return {"step": states[key]["step"]}
    return {}


def check_universal_groups(opt: Any, common: dict[str, Any]) -> None:
    """The saved ``param_groups`` must be as many as the optimizer's (checked before anything changes)."""
    current = opt.optimizer.state_dict()["param_groups"]
    saved = common.get("param_groups") or current
    if len(saved) != len(current):
        raise ValueError(f"universal checkpoint: the optimizer had {len(saved)} parameter groups, this one has "
                         f"{len(current)}")


def restore_universal_common(opt: Any, new_state: dict[int, dict[str, Any]], common: dict[str, Any]) -> None:
    """Loss scaler, the wrapped optimizer's per-group states and the saved ``param_groups`` (lr, betas, ...)."""
    from ds_zero.optimizer_state import _load_in_place

    if opt.loss_scaler is not None and common.get("loss_scaler"):
        opt.loss_scaler.load_state_dict({**opt.loss_scaler.state_dict(), **common["loss_scaler"]})
    current = opt.optimizer.state_dict()["param_groups"]
    saved = common.get("param_groups") or current
    if len(saved) != len(current):
        raise ValueError(f"universal checkpoint: the optimizer had {len(saved)} parameter groups, this one has "
                         f"{len(current)}")
    groups = [{**old, "params": now["params"]} for old, now in zip(saved, current, strict=True)]
    _load_in_place(opt.optimizer, {"state": new_state, "param_groups": groups})
