"""Pipeline checkpoints: DeepSpeed's layout, and loading onto another number of stages.

A stage writes its layers as ``layer_XX-model_states.pt`` files (``PipelineModule.ckpt_layer_path``: the global
layer index, plus ``-model_YY`` with a model axis) and ``mp_rank_SS_model_states.pt`` (``module: None``; its
optimizer, schedule and counters; SS = the rank inside the pipeline). Two keys are added to the latter: the
partition (``pipeline_parts``) and the global names of the optimizer's parameters in its order
(``pipeline_param_names``; parameter names of a ``PipelineModule`` are global layer indices, so a name means the
same parameter whatever the partition).

Loading with the same partition is the base engine's load. With another partition (a different number of stages,
or other boundaries) the layers load from their files by global index, counters and LR schedule come from
``mp_rank_00``, and the optimizer state of each parameter is found by name in every old stage's file (the stage-0
wrappers; ZeRO-1's partitioned state loads only onto the same partition).
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.runtime import checkpointing
from deepspeed.runtime.checkpointing import CheckpointError, PipelineLayerShards, load_file, model_states_name
from deepspeed.runtime.precision.optimizers import FP32Optimizer

_PARTS = "pipeline_parts"
_NAMES = "pipeline_param_names"


class _StageExtras:
    """The two keys this stage adds to its model-states file (no files of its own)."""

    owns_optimizer_state = False
    owns_module_state = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def model_state_extras(self) -> dict[str, Any]:
        return {_PARTS: list(self.engine.module.parts), _NAMES: _optimizer_param_names(self.engine)}

    def files_to_save(self, ctx: Any) -> dict[str, Any]:
        return {}

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        """Tied copies that were not saved as layers (``TiedLayerSpec(forward_fn=...)``) take the loaded one."""
        self.engine.module._synchronize_tied_weights()

    def load_universal(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_universal(ctx, load)()

    def prepare_universal(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        """This stage's parameters from ``zero/<global name>/fp32.pt`` (ZeRO's shard, which follows, restores its
        own partitions; a stage-0 wrapper's state is loaded by ``_OptimizerState``), read now, copied by the step."""
        from ds_zero.checkpoint import UNIVERSAL_ZERO, read_universal

        values = [(param, read_universal(ctx, load, name, "fp32", param.numel()).view_as(param))
                  for name, param in self.engine.module.named_parameters()
                  if os.path.isfile(os.path.join(ctx.tag_dir, UNIVERSAL_ZERO, name, "fp32.pt"))]

        def apply() -> None:
            with torch.no_grad():
                for param, value in values:
                    param.copy_(value)
            self.engine.module._synchronize_tied_weights()

        return apply


class _StageLayers(PipelineLayerShards):
    """The stage's layer files; from a Universal Checkpoint, the layers whose files were copied there (buffers;
    the weights are then set from ``zero/`` by :class:`_StageExtras`)."""

    def load_universal(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_universal(ctx, load)()

    def prepare_universal(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        layers = self.layers
        try:
            self.layers = [(i, layer) for i, layer in layers
                           if os.path.isfile(os.path.join(ctx.tag_dir, self._name(i, ctx)))]
            return self.prepare_load(ctx, load)
        finally:
            self.layers = layers


class _OptimizerState:
    """A stage-0 optimizer state built from other files than this rank's model states (every old stage's file on a
    re-partitioned load, the universal folders), read during the load's read phase and restored by its step; with
    no ``build`` the masters follow the loaded weights."""

    owns_optimizer_state = False
    owns_module_state = False

    def __init__(self, optimizer: Any, build: Callable[[], dict[str, Any]] | None) -> None:
        self.optimizer, self.build = optimizer, build

    def model_state_extras(self) -> dict[str, Any]:
        return {}

    def files_to_save(self, ctx: Any) -> dict[str, Any]:
        return {}

    def prepare_load(self, ctx: Any, load: Callable[[str], Any]) -> Callable[[], None]:
        if self.build is None:
            return self.optimizer.sync_master_from_model
        state = self.build()
        return lambda: self.optimizer.load_state_dict(state)

    prepare_universal = prepare_load

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        self.prepare_load(ctx, load)()

    load_universal = load_files


def _read_first(path: str) -> dict[str, Any] | None:
    """Stage 0's model states (memory-mapped), or None when unreadable: the load then reads it in its read phase
    and reports the damage on every rank instead of this rank failing alone."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return saved if isinstance(saved, dict) else None


def stage_shards(engine: Any) -> tuple[Any, ...]:
    """The checkpoint extensions of one pipeline stage: its layer files and its model-states keys."""
    module = engine.module
    layers = [(module._local_start + i, f) for i, f in enumerate(module.forward_funcs)
              if isinstance(f, torch.nn.Module)]
    by_index = {index: module.ckpt_layer_path("", index - module._local_start) for index, _ in layers}
    return _StageLayers(layers, file_name=lambda index: os.path.basename(by_index[index])), _StageExtras(engine)


def _optimizer_model_params(wrapper: Any) -> list[torch.nn.Parameter] | None:
    """The model parameters behind the stage-0 wrapper's optimizer entries, in its state-dict order."""
    if not isinstance(wrapper, FP32Optimizer):
        return None  # no optimizer, or ZeRO (partitioned state)
    model_params = getattr(wrapper, "model_params", None)
    if model_params is not None:
        return list(model_params)
    return [p for group in wrapper.optimizer.param_groups for p in group["params"]]


def _optimizer_param_names(engine: Any) -> list[str] | None:
    params = _optimizer_model_params(engine.optimizer)
    if params is None:
        return None
    names: dict[int, str] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return [names[id(p)] for p in params]


def load(engine: Any, base_load: Callable[..., Any], load_dir: str, tag: Any, **kwargs: Any) -> Any:
    """``engine.load_checkpoint``: the base load when the partition is unchanged, else the re-partitioning load;
    with ``checkpoint.load_universal`` the Universal Checkpoint load (any partition, any data-parallel size)."""
    if checkpointing.as_engine_state(engine).checkpoint_config.load_universal:
        return _load_universal(engine, load_dir, tag, **kwargs)
    if tag is None:
        try:
            tag = checkpointing.read_latest(load_dir)
        except CheckpointError:  # damaged: the base load reports it on every rank, through its agreement
            tag = None
    if tag is None:
        return base_load(load_dir, None, **kwargs)
    first = os.path.join(load_dir, str(tag), model_states_name(0))
    if not os.path.isfile(first):
        return base_load(load_dir, tag, **kwargs)
    saved = _read_first(first)
    parts = None if saved is None else saved.get(_PARTS)
    if parts is None or list(parts) == list(engine.module.parts):
        return base_load(load_dir, tag, **kwargs)
    return _load_repartitioned(engine, load_dir, str(tag), saved, **kwargs)


def _load_repartitioned(engine: Any, load_dir: str, tag: str, first: dict[str, Any], load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
    module = engine.module
    if first[_PARTS][-1] != module.parts[-1]:
        raise CheckpointError(f"{load_dir}/{tag}: the checkpoint's pipeline has {first[_PARTS][-1]} layers, this "
                              f"PipelineModule has {module.parts[-1]}: they are different models")
    restore_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    if restore_optimizer and _optimizer_model_params(engine.optimizer) is None:
        raise CheckpointError(f"{load_dir}/{tag} was saved with pipeline partition {first[_PARTS]}, this engine runs "
                              f"{module.parts}: ZeRO's partitioned optimizer state loads only onto the same "
                              "partition; pass load_optimizer_states=False (weights, schedule and counters load) or "
                              "use the saved number of stages")
    shards = tuple(stage_shards(engine))
    if engine.optimizer is not None:  # read with every other file, before the ranks agree
        build = (lambda: _gather_optimizer_state(engine, load_dir, tag, first)) if restore_optimizer else None
        shards = (*shards, _OptimizerState(engine.optimizer, build))
    state = checkpointing.as_engine_state(engine)
    state = dataclasses.replace(state, parallel=dataclasses.replace(state.parallel, mp_rank=0), shards=shards)
    path, client_state = checkpointing.load_checkpoint(
        state, load_dir, tag=tag, load_module_strict=load_module_strict, load_optimizer_states=False,
        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
        custom_load_fn=custom_load_fn)
    if client_state is not None:
        client_state = {k: v for k, v in client_state.items() if k not in ("optimizer", _PARTS, _NAMES)}
    return path, client_state


def _gather_optimizer_state(engine: Any, load_dir: str, tag: str, first: dict[str, Any]) -> dict[str, Any]:
    """This stage's optimizer state dict, assembled by parameter name from every saved stage's file."""
    by_name: dict[str, tuple[dict[str, Any], Any]] = {}
    groups = scaler = None
    for mp_rank in range(int(first.get("mp_world_size", 1))):
        path = os.path.join(load_dir, tag, model_states_name(mp_rank))
        saved = first if mp_rank == 0 else load_file(path)
        names, optimizer = saved.get(_NAMES), saved.get("optimizer")
        if names is None or optimizer is None:
            raise CheckpointError(f"{path}: no optimizer state by parameter name (saved without an optimizer, or by "
                                  "ZeRO); load with load_optimizer_states=False")
        # plain (fp32 stage 0, as DeepSpeed writes it) or wrapped with the masters and scaler (bf16/fp16)
        inner = optimizer.get("optimizer_state_dict", optimizer)
        masters = optimizer.get("fp32_master_weights")
        groups = groups if groups is not None else inner["param_groups"]
        scaler = scaler if scaler is not None else optimizer.get("loss_scaler")
        for index, name in enumerate(names):
            by_name.setdefault(name, (inner["state"].get(index, {}), None if masters is None else masters[index]))
    mine = _optimizer_param_names(engine)
    missing = [name for name in mine if name not in by_name]
    if missing:
        raise CheckpointError(f"{load_dir}/{tag}: no optimizer state for parameters {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} in any stage's file")
    current = engine.optimizer.optimizer.state_dict()["param_groups"]
    if len(groups) != len(current):
        raise CheckpointError(f"{load_dir}/{tag}: the checkpoint's optimizer has {len(groups)} parameter groups, "
                              f"this one {len(current)}")
    param_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": now["params"]}
                    for saved, now in zip(groups, current, strict=True)]
    result: dict[str, Any] = {"optimizer_state_dict": {
        "state": {i: by_name[name][0] for i, name in enumerate(mine) if by_name[name][0]},
        "param_groups": param_groups}}
    if hasattr(engine.optimizer, "master_of"):
        result["fp32_master_weights"] = [by_name[name][1] for name in mine]
    if scaler is not None:
        result["loss_scaler"] = scaler
    return result


# ---- Universal Checkpoints (ds_to_universal's zero/<global name>/ folders) ---------------------------------------

def _load_universal(engine: Any, load_dir: str, tag: Any, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
    """Counters, schedule and client state from ``mp_rank_00`` (the same on every stage); every rank reads only the
    ``zero/<name>/`` folders of its stage's parameters (global names), so any number of stages and data-parallel
    ranks loads a checkpoint converted from any pipeline layout."""
    from deepspeed.checkpoint import universal as uc

    if engine.optimizer is not None:
        engine._require_states_in_place("load_checkpoint")
    try:
        tag = uc.resolve_universal_tag(os.fspath(load_dir), tag)
    except CheckpointError:  # no or a damaged latest_universal: the load raises it on every rank, agreed
        return checkpointing.load_checkpoint(engine, load_dir, tag=None)
    first = os.path.join(os.fspath(load_dir), tag, model_states_name(0))
    saved = _read_first(first) if os.path.isfile(first) else None
    if saved is not None:
        parts = saved.get(_PARTS)
        if parts is not None and parts[-1] != engine.module.parts[-1]:
            raise CheckpointError(f"{load_dir}/{tag}: the checkpoint's pipeline has {parts[-1]} layers, this "
                                  f"PipelineModule has {engine.module.parts[-1]}: they are different models")
    stage0 = _optimizer_model_params(engine.optimizer) is not None  # else ZeRO's shard restores its state
    state = checkpointing.as_engine_state(engine)
    shards = tuple(state.shards)
    if stage0:  # the wrapper's state from the universal folders, read with every other file
        tag_dir = os.path.join(os.fspath(load_dir), tag)
        with_state = load_optimizer_states and not load_module_only
        shards = (*shards, _OptimizerState(engine.optimizer, (lambda: _universal_optimizer_state(engine, tag_dir))
                                           if with_state else None))
    state = dataclasses.replace(state, parallel=dataclasses.replace(state.parallel, mp_rank=0), shards=shards)
    path, client_state = checkpointing.load_checkpoint(
        state, load_dir, tag=tag, load_module_strict=load_module_strict,
        load_optimizer_states=load_optimizer_states and not stage0, load_lr_scheduler_states=load_lr_scheduler_states,
        load_module_only=load_module_only, custom_load_fn=custom_load_fn)
    if client_state is not None:
        client_state = {k: v for k, v in client_state.items() if k not in ("optimizer", _PARTS, _NAMES)}
    return path, client_state


def _universal_optimizer_state(engine: Any, tag_dir: str) -> dict[str, Any]:
    """A stage-0 wrapper's state dict (``FP32Optimizer``) built from the universal folders of its parameters."""
    from deepspeed.checkpoint.universal import stage0_optimizer_state
    from ds_zero.checkpoint import read_universal

    ctx = types.SimpleNamespace(tag_dir=tag_dir)  # what the universal readers use
    trusted = checkpointing.as_engine_state(engine).trusted_load

    def load(name: str) -> Any:
        return load_file(os.path.join(tag_dir, name), trusted=trusted)

    names = _optimizer_param_names(engine)
    params = _optimizer_model_params(engine.optimizer)
    optimizer_state, common = stage0_optimizer_state(ctx, load, names, params,
                                                     engine.optimizer.optimizer.state_dict()["param_groups"])
    result: dict[str, Any] = {"optimizer_state_dict": optimizer_state}
    if hasattr(engine.optimizer, "master_of"):
        result["fp32_master_weights"] = [read_universal(ctx, load, name, "fp32", p.numel()).view(p.shape)
                                         for name, p in zip(names, params, strict=True)]
    if common.get("loss_scaler") and getattr(engine.optimizer, "loss_scaler", None) is not None:
        result["loss_scaler"] = common["loss_scaler"]
    return result
