"""What the checkpointing layer needs from a training engine, bundled as plain dataclasses.

The engine builds an :class:`EngineState` once (or per call) and hands it to ``save_checkpoint`` /
``load_checkpoint``; loading writes the restored counters back into ``state.counters`` in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ds_config.checkpoint import CheckpointConfig


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: an optimizer (wrapper) or an LR scheduler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@runtime_checkable
class Counters(Protocol):
    """The four progress counters; loading sets them with ``setattr`` (an engine can pass itself)."""

    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int


@dataclass
class TrainingCounters:
    """The engine's progress counters, saved in the model-states file and restored on load."""

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the job. ``from_environment()`` fills it for pure data parallelism."""

    global_rank: int = 0
    local_rank: int = 0
    dp_rank: int = 0
    dp_world_size: int = 1
    dp_group: Any = None
    mp_rank: int = 0
    mp_world_size: int = 1

    @classmethod
    def from_environment(cls, dp_group: Any = None) -> ParallelInfo:
        """Ranks from ``torch.distributed`` (data parallel over ``dp_group`` or the world) and ``LOCAL_RANK``."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        return cls(
            global_rank=dist.get_rank(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            dp_rank=dist.get_rank(dp_group),
            dp_world_size=dist.get_world_size(dp_group),
            dp_group=dp_group,
        )


@dataclass(frozen=True)
class SyncOptions:
    """How ranks meet at a collective checkpoint call (see ``_sync``).

    ``group``: the ranks that save/load together (None: the whole world). ``store``: the key-value store they
    meet in (None: the default process group's store). ``timeout_s``: how long a rank waits for the others
    at each meeting point before failing with the ranks that did not arrive (None: ``DS_CHECKPOINT_TIMEOUT``
    seconds, else ``deepspeed.comm``'s process-group timeout, 30 minutes by default).
    """

    group: Any = None
    store: Any = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class ShardContext:
    """What a :class:`CheckpointShards` extension sees when it saves or loads its files."""

    tag_dir: str
    parallel: ParallelInfo
    config: CheckpointConfig
    exclude_frozen_parameters: bool = False
    load_optimizer_states: bool = True
    load_module_only: bool = False
    load_module_strict: bool = True
    custom_load_fn: Callable[..., Any] | None = None


@runtime_checkable
class CheckpointShards(Protocol):
    """Extension point for per-rank files beside the model states (ZeRO optimizer shards, pipeline layers).

    ``owns_optimizer_state``: when True the model-states file stores ``optimizer: None`` (the shards hold
    it, as with ZeRO) and loading leaves the optimizer to :meth:`load_files`.
    ``model_states_name(dp_rank, mp_rank)`` (optional): every data-parallel rank writes its own model-states file
    under this name (ZeRO-3's ``zero_pp_rank_<r>_mp_rank_XX_model_states.pt``) instead of rank 0 writing
    ``mp_rank_XX_model_states.pt``.
    ``owns_module_state`` (optional, default False): likewise for the weights (``module: None``), as with
    pipeline layer files (:class:`PipelineLayerShards`).
    ``model_state_extras()``: keys merged into the model-states file (e.g. ZeRO's ``param_shapes``).
    ``files_to_save(ctx)``: ``{file name inside the tag dir: object}`` this rank writes (each atomically).
    ``files_to_copy(ctx)`` (optional): ``{file name: source path}`` of plain files copied into the save dir,
    beside ``latest`` (ZeRO's ``zero_to_fp32.py``).
    ``load_files(ctx, load)``: restore from this rank's files; ``load(name)`` returns a file's object read with
    ``torch.load(weights_only=True)`` and clear errors for missing or corrupt files.
    ``prepare_load(ctx, load)`` / ``prepare_universal(ctx, load)`` (optional, preferred): read and check every
    file, changing nothing and entering no collective, and return the function that applies them; the loader
    calls it only after every rank's reads succeeded (see ``_restore``). Errors may carry ``checkpoint_path`` and
    ``reason`` attributes, reported as ``<file>: <reason>`` (``_agreement``).
    """

    owns_optimizer_state: bool

    def model_state_extras(self) -> Mapping[str, Any]: ...

    def files_to_save(self, ctx: ShardContext) -> Mapping[str, Any]: ...

    def load_files(self, ctx: ShardContext, load: Callable[[str], Any]) -> None: ...


@dataclass
class EngineState:
    """Everything a checkpoint saves or restores for one engine.

    ``counters`` is any object with the four counter attributes (the engine itself works: loading updates
    it in place). ``ds_config`` is the job's config as a JSON-like dict (stored under ``ds_config``);
    ``checkpoint_config`` its typed ``checkpoint`` section. ``trusted_load=True`` lets files that hold arbitrary
    Python objects load with ``weights_only=False``: only for checkpoints you wrote yourself.
    ``data_sampler`` / ``random_ltd``: the data-efficiency states DeepSpeed keeps in the model-states file.
    """

    module: torch.nn.Module
    optimizer: Stateful | None = None
    lr_scheduler: Stateful | None = None
    counters: Counters = field(default_factory=TrainingCounters)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    ds_config: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelInfo = field(default_factory=ParallelInfo.from_environment)
    sync: SyncOptions = field(default_factory=SyncOptions)
    shards: Sequence[CheckpointShards] = ()
    trusted_load: bool = False
    data_sampler: Stateful | None = None  # curriculum DeepSpeedDataSampler, saved under "data_sampler"
    random_ltd: Stateful | None = None  # RandomLTDScheduler, saved under "random_ltd"
    # the engine's load_module_state_dict(checkpoint, strict=, custom_load_fn=): loads the weights instead of
    # module.load_state_dict, so an engine subclass's override decides (None: module.load_state_dict)
    load_module_state_dict: Callable[..., None] | None = None

    def optimizer_in_shards(self) -> bool:
        """Whether an extension (ZeRO) saves the optimizer instead of the model-states file."""
        return any(shard.owns_optimizer_state for shard in self.shards)

    def module_in_shards(self) -> bool:
        """Whether an extension (pipeline layer files) saves the weights instead of the model-states file."""
        return any(getattr(shard, "owns_module_state", False) for shard in self.shards)


def per_rank_model_states(state: EngineState) -> Callable[[int, int], str] | None:
    """The per-rank model-states file name of an extension that asks for one (ZeRO-3), else None."""
    for shard in state.shards:
        name = getattr(shard, "model_states_name", None)
        if name is not None:
            return name
    return None
