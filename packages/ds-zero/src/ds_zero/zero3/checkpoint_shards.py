"""ZeRO-3 files in a training checkpoint, in DeepSpeed's stage-3 layout.

Every data-parallel rank writes its own model-states file, ``zero_pp_rank_<r>_mp_rank_XX_model_states.pt``
(buffers, counters, ``param_shapes``; partitioned weights appear as empty tensors, frozen ones as this rank's
fragment in ``frozen_param_fragments``), and its optimizer file ``zero_pp_rank_<r>_mp_rank_XX_optim_states.pt``
with the flat fp32 partitions (``fp32_flat_groups``, see ``checkpoint``). Loading reuses the stage 1/2 logic
(this rank's file, or every saved rank's when the world size changed).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_zero.checkpoint import ZeroCheckpointShards, shared_params
from ds_zero.zero3.param import partition_copy
from ds_zero.zeropp.frozen import is_stored_quantized, partition_values, write_full


def _fragment(p: torch.nn.Parameter) -> torch.Tensor:
    """A frozen parameter's partition as values: from NVMe (``partition_copy``), dequantized where it is stored
    quantized, or the whole tensor of an unpartitioned parameter."""
    if not hasattr(p, "ds_tensor"):
        return p.detach().clone()
    return partition_values(p).detach().clone() if is_stored_quantized(p) else partition_copy(p)


def model_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


class Zero3CheckpointShards(ZeroCheckpointShards):
    """The engine's checkpoint extension for a ``DeepSpeedZeroOptimizer_Stage3``."""

    def __init__(self, optimizer: Any, module: torch.nn.Module, ds_config: Mapping[str, Any], ds_version: str,
                 bf16: bool = False) -> None:
        super().__init__(optimizer, module, ds_config, ds_version, bf16=bf16)

    @staticmethod
    def model_states_name(dp_rank: int, mp_rank: int = 0) -> str:
        return model_states_name(dp_rank, mp_rank)

    def model_state_extras(self) -> Mapping[str, Any]:
        frozen = {name: p for name, p in self.module.named_parameters() if not p.requires_grad}
        return {
            "param_shapes": [OrderedDict((name, p.ds_shape) for name, p in zip(g.names, g.params, strict=True))
                             for g in self.optimizer.groups],
            "frozen_param_shapes": {name: getattr(p, "ds_shape", p.shape) for name, p in frozen.items()} or None,
            "frozen_param_fragments": {name: _fragment(p) for name, p in frozen.items()} or None,
            "shared_params": shared_params(self.module),
            # MiCS: frozen fragments are cut over the shard group, not the whole data-parallel group
            **({"frozen_partition_count": int(getattr(self.optimizer, "world", 1))} if frozen else {}),
        }

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_load(ctx, load)()

    def prepare_load(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        """The weights live only in these files at stage 3 (the model-states file holds empty tensors), so they
        are restored whatever the load options; the optimizer states only when asked. Reads and checks every file
        now (no collective, nothing changed); the returned step applies them (gathers included)."""
        self._check_shapes(ctx, load)
        frozen = self._read_frozen(ctx, load)
        with_state = not (ctx.load_module_only or not ctx.load_optimizer_states)
        opt_world = getattr(self.optimizer, "world", ctx.parallel.dp_world_size)
        if opt_world != ctx.parallel.dp_world_size:  # MiCS: the optimizer files are those of a shard group
            ctx = dataclasses.replace(ctx, parallel=dataclasses.replace(ctx.parallel, dp_rank=self.optimizer.rank,
                                                                        dp_world_size=opt_world))
        state = self._read_optimizer_files(ctx, load)

        def apply() -> None:
            if frozen:
                for param, whole in frozen:
                    write_full(param, whole)  # (quantized again where zero_quantized_nontrainable_weights stores it)
                self.optimizer.partitions_changed()
            self.optimizer.restore_optimizer_state = with_state
            try:
                self.optimizer.load_state_dict(state)
            finally:
                self.optimizer.restore_optimizer_state = True

        return apply

    def _check_states(self, ctx: Any, names: list[str], states: list[dict[str, Any]], same_layout: bool) -> None:
        """Stage 3's keys and group count in every file; on the same layout, partition sizes of this rank's."""
        from ds_zero.checkpoint import check_partition_sizes, file_error, per_element_states
        from ds_zero.zero3.checkpoint import BASE_STATE, FP32_GROUPS, _check, _same_layout

        opt = self.optimizer
        for name, sd in zip(names, states, strict=True):
            try:
                _check(opt, [sd])
            except ValueError as exc:
                raise file_error(ctx.tag_dir, name, str(exc)) from None
        if not same_layout or not _same_layout(opt, states):
            return
        base = states[0][BASE_STATE].get("state", {}) if isinstance(states[0][BASE_STATE], dict) else {}
        for g, (group, master) in enumerate(zip(opt.groups, states[0][FP32_GROUPS], strict=True)):
            tensors = {FP32_GROUPS: master, **per_element_states(opt, g, master, base.get(g, {}), (group.numel,),
                                                                    BASE_STATE)}
            check_partition_sizes(ctx.tag_dir, names[0], g, tensors, (group.numel,))

    def load_universal(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_universal(ctx, load)()

    def prepare_universal(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        """From a Universal Checkpoint folder: each parameter's ``zero/<name>/*.pt`` is read and only this rank's
        slice of it kept (the weights always, Adam's states when asked). Reads now; the returned step applies."""
        from ds_zero.checkpoint import (
            EXPERT_ROWS_ATTR,
            check_universal_folders,
            check_universal_groups,
            read_universal,
            read_universal_common,
            restore_universal_common,
            universal_keys,
            universal_step,
        )
        from ds_zero.zero3.checkpoint import _zero_padding

        opt = self.optimizer
        check_universal_folders(ctx.tag_dir, [name for group in opt.groups for name in group.names])
        with_state = ctx.load_optimizer_states and not ctx.load_module_only
        common = read_universal_common(ctx, load) if with_state else {}
        masters, new_state = [], {}
        for g, group in enumerate(opt.groups):
            flats = {key: torch.zeros(group.numel, dtype=torch.float32)
                     for key in universal_keys(ctx.tag_dir, group.names, with_state)}
            for name, p, offset in zip(group.names, group.params, group.offsets, strict=True):
                part = p.ds_tensor.numel()
                start = min(p.ds_space.rank * part, p.ds_numel)
                end = min(start + part, p.ds_numel)
                if start >= end:
                    continue
                for key, flat in flats.items():
                    # an AutoEP expert's file holds every expert-parallel rank's experts: this rank's rows
                    value = read_universal(ctx, load, name, key, p.ds_numel, getattr(p, EXPERT_ROWS_ATTR, None))
                    flat[offset:offset + end - start] = value[start:end]
            masters.append(flats.pop("fp32"))
            if flats:
                new_state[g] = {**universal_step(ctx, load, group.names, common, g), **flats}
        if with_state:
            check_universal_groups(opt, common)

        def apply() -> None:
            if with_state:
                restore_universal_common(opt, new_state, common)
            with torch.no_grad():
                for group, master in zip(opt.groups, masters, strict=True):
                    group.master.data.copy_(master)
                    _zero_padding(group)
                    group.copy_master_to_lp()
            opt.partitions_changed()  # whole copies (persistent small parameters) still hold the old values

        return apply

    def _check_shapes(self, ctx: Any, load: Callable[[str], Any]) -> None:
        """Before anything is changed: every saved parameter shape must be the model's (names the first that is
        not), so a checkpoint of another model loads nothing."""
        saved = getattr(load, "mapped", load)(self.model_states_name(0, ctx.parallel.mp_rank))  # read once per load
        shapes: dict[str, Any] = {}
        for group in saved.get("param_shapes") or []:
            shapes.update(group)
        shapes.update(saved.get("frozen_param_shapes") or {})
        for name, p in self.module.named_parameters():
            if name in shapes and tuple(shapes[name]) != tuple(getattr(p, "ds_shape", p.shape)):
                from ds_zero.checkpoint import file_error

                raise file_error(ctx.tag_dir, self.model_states_name(0, ctx.parallel.mp_rank), f"wrong shape: "
                                 f"parameter {name!r} has shape {tuple(shapes[name])} in the checkpoint and "
                                 f"{tuple(getattr(p, 'ds_shape', p.shape))} in the model (a checkpoint of another "
                                 "model?)")

    def _read_frozen(self, ctx: Any, load: Callable[[str], Any]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Frozen parameters: every saved rank's ``frozen_param_fragments``, put together; ``(param, whole value)``."""
        from ds_zero.checkpoint import file_error

        frozen = {name: p for name, p in self.module.named_parameters() if not p.requires_grad and hasattr(p, "ds_id")}
        if not frozen:
            return []
        first = self.model_states_name(0, ctx.parallel.mp_rank)
        read = getattr(load, "mapped", load)  # the fragments are put together by torch.cat: copies of their own
        own = read(first)
        saved_world = int(own.get("frozen_partition_count") or own.get("dp_world_size") or 1)
        names = [first] + [self.model_states_name(r, ctx.parallel.mp_rank) for r in range(1, saved_world)]
        states = [own] + [read(name) for name in names[1:]]
        out = []
        for name, param in frozen.items():
            pieces = [(sd.get("frozen_param_fragments") or {}).get(name) for sd in states]
            lacking = [n for n, piece in zip(names, pieces, strict=True) if not torch.is_tensor(piece)]
            if lacking:
                raise file_error(ctx.tag_dir, lacking[0], f"missing key: frozen parameter {name!r} has no "
                                 "'frozen_param_fragments' entry; the checkpoint does not hold its weights")
            whole = torch.cat([piece.reshape(-1) for piece in pieces])[:param.ds_numel]
            if whole.numel() != param.ds_numel:
                raise file_error(ctx.tag_dir, first, f"wrong shape: frozen parameter {name!r} has {whole.numel()} "
                                 f"elements in the checkpoint and {param.ds_numel} (shape {tuple(param.ds_shape)}) "
                                 "in the model")
            out.append((param, whole))
        return out

    def _layout_from_param_shapes(self, ctx: Any, load: Callable[[str], Any], saved_world: int) -> list[dict]:
        name = model_states_name(0, ctx.parallel.mp_rank)
        shapes = getattr(load, "mapped", load)(name).get("param_shapes")
        if not shapes:
            raise ValueError(f"{name} has no 'param_shapes', so the ZeRO-3 partitions of {ctx.tag_dir} cannot be "
                             f"cut for {ctx.parallel.dp_world_size} ranks; load it on {saved_world}")
        return [{"names": list(group), "numels": [int(torch.Size(s).numel()) for s in group.values()]}
                for group in shapes]
