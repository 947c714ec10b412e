"""An :class:`EngineState` read off a ``DeepSpeedEngine``-like object, so the engine can pass ``self``.

Reads DeepSpeed's public engine attributes (``module``, ``optimizer``, ``lr_scheduler``, the four counters,
``config`` dict, ``global_rank``, ``local_rank``, ``dp_group``, ``dp_world_size``) plus, when present, the typed
config ``_config.checkpoint``, ``mp_rank``/``mp_world_size`` and ``checkpoint_shards`` (the extensions, e.g.
the ZeRO optimizer, register there), and the data-efficiency states (the curriculum sampler of
``training_dataloader``, ``random_ltd_scheduler``). The counters are the engine itself, so a load updates them
in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.checkpointing._state import EngineState, ParallelInfo
from ds_config.checkpoint import CheckpointConfig

_REQUIRED = ("module", "optimizer", "lr_scheduler", "global_steps", "global_samples", "micro_steps", "skipped_steps")


def _typed_checkpoint_config(engine: Any) -> CheckpointConfig:
    typed = getattr(getattr(engine, "_config", None), "checkpoint", None)
    if isinstance(typed, CheckpointConfig):
        return typed
    raw = getattr(engine, "config", None)
    section = raw.get("checkpoint") if isinstance(raw, dict) else None
    return CheckpointConfig.model_validate(section or {})


def _parallel(engine: Any) -> ParallelInfo:
    # sequence parallelism: ZeRO partitions over the sequence-data group, whose ranks hold different shards; as in
    # DeepSpeed the files are named by the rank in that group (by the data-parallel rank, sequence ranks collide)
    seq = int(getattr(engine, "sequence_parallel_size", 1) or 1) > 1
    group = getattr(engine, "seq_dp_group" if seq else "dp_group", None)
    distributed = dist.is_available() and dist.is_initialized()
    dp_size = int(getattr(engine, "seq_dp_world_size" if seq else "dp_world_size",
                          dist.get_world_size(group) if distributed else 1))
    return ParallelInfo(
        global_rank=int(getattr(engine, "global_rank", dist.get_rank() if distributed else 0)),
        local_rank=int(getattr(engine, "local_rank", 0)),
        dp_rank=dist.get_rank(group) if distributed and dp_size > 1 else 0,
        dp_world_size=dp_size,
        dp_group=group,
        mp_rank=int(getattr(engine, "checkpoint_mp_rank", getattr(engine, "mp_rank", 0))),  # files' mp_rank_XX
        mp_world_size=int(getattr(engine, "mp_world_size", 1)),
    )


def as_engine_state(obj: Any) -> EngineState:
    """``obj`` itself when it is an :class:`EngineState`, else one built from an engine's attributes."""
    if isinstance(obj, EngineState):
        return obj
    missing = [name for name in _REQUIRED if not hasattr(obj, name)]
    if missing or not isinstance(getattr(obj, "module", None), torch.nn.Module):
        raise TypeError(
            f"checkpointing: expected an EngineState or a DeepSpeedEngine-like object, got {type(obj).__name__} "
            f"(missing attributes {missing or ['module (an nn.Module)']})"
        )
    config = getattr(obj, "config", None)
    return EngineState(
        module=obj.module,
        optimizer=obj.optimizer,
        lr_scheduler=obj.lr_scheduler,
        counters=obj,
        checkpoint_config=_typed_checkpoint_config(obj),
        ds_config=config if isinstance(config, dict) else {},
        parallel=_parallel(obj),
        shards=tuple(getattr(obj, "checkpoint_shards", ())),
        data_sampler=_curriculum_sampler(obj),
        random_ltd=getattr(obj, "random_ltd_scheduler", None),
        load_module_state_dict=getattr(obj, "load_module_state_dict", None),
    )


def _curriculum_sampler(engine: Any) -> Any:
    """The training loader's ``DeepSpeedDataSampler`` when it samples by curriculum, else None."""
    loader = getattr(engine, "training_dataloader", None)
    return loader.data_sampler if getattr(loader, "curriculum_learning_enabled", False) else None


def unwrap_module(module: Any) -> torch.nn.Module:
    """The model inside an engine (``engine.module``), or ``module`` itself; DeepSpeed saves unprefixed keys."""
    inner = getattr(module, "module", None)
    if isinstance(inner, torch.nn.Module) and hasattr(module, "global_steps"):
        return inner
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"save_16bit_model: module must be an nn.Module or an engine, got {type(module).__name__}")
    return module
