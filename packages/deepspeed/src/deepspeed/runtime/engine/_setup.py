"""The steps of ``DeepSpeedEngine.__init__`` that set the engine up around its module: ranks and device, the
module's distribution (MoE groups, ZeRO-3 partitions or a broadcast), the sequence-parallel checks, the
checkpoint shards of MoE and AutoTP, the features attached after the optimizer (data efficiency, training
loader, monitor, FLOPs profiler, autotuning probe, compile) and the start-up log.

Functions over the engine, so that the engine class reads as the training loop; the order of the calls in the
constructor is the order DeepSpeed sets these up in.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.__about__ import __version__
from deepspeed.accelerator import get_accelerator
from deepspeed.autotuning.probe import attach_probe as attach_autotuning_probe
from deepspeed.runtime.engine import _data_efficiency, _eigenvalue, _module, _moe, _pld, _reporting
from deepspeed.runtime.engine._autoep_folding import AutoEPFoldingCheckpointShards, bind_folding, folding_spec_of
from deepspeed.utils import log_dist, set_log_level_from_string
from ds_config import ConfigError, ConfigProblem

# model -> the training engines whose gradient hooks are on its parameters (weak: keeps neither alive)
_TRAINERS_OF: weakref.WeakKeyDictionary[torch.nn.Module, list[weakref.ref]] = weakref.WeakKeyDictionary()


def place(engine: Any, mpu: Any, dp_group: Any) -> None:
    """Ranks, groups and device. ``mpu`` (a model-parallel unit) supplies the data-parallel group."""
    if mpu is not None and dp_group is None:
        dp_group = mpu.get_data_parallel_group()
    engine.mpu = mpu
    # a sequence-parallel mpu (the parallel_state_sp module) calls its sequence axis "model parallel", but the
    # weights are replicated over it: as DeepSpeed, no model parallelism, one file set named mp_rank_00
    model_parallel = mpu is not None and not hasattr(mpu, "initialize_sequence_parallel")
    engine.mp_rank = mpu.get_model_parallel_rank() if model_parallel else 0
    engine.mp_world_size = mpu.get_model_parallel_world_size() if model_parallel else 1
    engine.checkpoint_mp_rank = engine.mp_rank if engine.mp_world_size > 1 else 0  # the mp_rank_XX of files
    engine.dp_group = dp_group
    distributed = dist.is_available() and dist.is_initialized()
    engine.dp_world_size = dist.get_world_size(dp_group) if distributed else 1
    # sequence parallelism (an mpu with a sequence axis, DeepSpeed-Ulysses): gradients are summed over the
    # sequence ranks and averaged over data parallelism, in one reduction over the sequence-data group
    sp = int(mpu.get_sequence_parallel_world_size()) if hasattr(mpu, "get_sequence_parallel_world_size") else 1
    engine.sequence_parallel_size = sp
    engine.seq_dp_group = mpu.get_sequence_data_parallel_group() if sp > 1 else dp_group
    engine.seq_dp_world_size = dist.get_world_size(engine.seq_dp_group) if distributed and sp > 1 \
        else engine.dp_world_size
    _name_groups(engine, mpu, distributed)
    engine.global_rank = dist.get_rank() if distributed else 0
    engine.world_size = dist.get_world_size() if distributed else 1
    _apply_logging_and_mesh_keys(engine, engine._config)
    engine.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator = get_accelerator()
    accelerator.set_device(engine.local_rank)  # one device per local rank (a no-op on the CPU)
    engine.device = torch.device(accelerator.device_name(engine.local_rank))


def _name_groups(engine: Any, mpu: Any, distributed: bool) -> None:
    """DeepSpeed's names for the engine's groups (client code reduces over them): ``data_parallel_group``,
    ``seq_data_parallel_group`` and, with sequence parallelism only (as DeepSpeed), ``seq_parallel_group`` (when the
    mpu names its sequence group)."""
    world = dist.group.WORLD if distributed else None
    engine.data_parallel_group = engine.dp_group if engine.dp_group is not None else world
    engine.seq_data_parallel_group = engine.seq_dp_group if engine.seq_dp_group is not None else world
    if engine.sequence_parallel_size > 1 and hasattr(mpu, "get_sequence_parallel_group"):
        engine.seq_parallel_group = mpu.get_sequence_parallel_group()


def _apply_logging_and_mesh_keys(engine: Any, config: Any) -> None:
    """``log_level`` sets DeepSpeed's logger (and its handlers); ``data_parallel_size`` must be the data-parallel
    size the groups have (world / sequence_parallel_size without an mpu)."""
    if engine.log_level() is not None:
        set_log_level_from_string(engine.log_level())
    wanted = config.data_parallel_size
    if wanted is not None and wanted != engine.dp_world_size:
        raise ConfigError(ConfigProblem("data_parallel_size", f"the data-parallel group has {engine.dp_world_size} "
                                        f"ranks (world size {engine.world_size}, sequence_parallel_size "
                                        f"{engine.sequence_parallel_size}); set it to "
                                        f"{engine.dp_world_size} or leave it out", wanted))


def distribute_module(engine: Any, config: Any, mpu: Any) -> None:
    """MoE expert groups, then ZeRO-3 partitioning or the broadcast of rank 0's weights; sets
    ``has_moe_layers`` and ``zero3_scheduler`` (which gathers and releases the partitioned parameters around
    each module under ZeRO-3, else None)."""
    engine.has_moe_layers = _moe.has_moe(engine.module)
    if engine.has_moe_layers:
        if config.zero_stage == 3:  # AutoEP layers only, without MiCS/hpZ/qgZ/sequence parallelism
            engine._validate_zero3_moe_compatibility()
        _moe.configure(engine.module, mpu, config.use_data_before_expert_parallelism)
    engine.zero3_scheduler = None
    if config.zero_stage == 3:
        from deepspeed.runtime.engine._zero3 import partition_model

        # partitioned over the sequence-data group: sequence ranks hold the same weights (DeepSpeed's seq_dp);
        # AutoEP experts over their expert-data-parallel groups
        placements = _moe.zero3_placements(engine.module) if engine.has_moe_layers else ()
        engine.zero3_scheduler = partition_model(engine.module, config, engine.seq_dp_group, engine.device, mpu,
                                                 placements=placements)
    elif engine.has_moe_layers:
        _moe.broadcast_module(engine.module, engine.dp_group)
    else:
        _module.broadcast_module(engine.module, engine.seq_dp_group)
    if engine.sequence_parallel_size > 1 and engine.has_moe_layers:
        raise ConfigError(ConfigProblem("sequence_parallel_size", "sequence parallelism trains models without "
                                        "MoE layers in this version; accepted: 1", engine.sequence_parallel_size))


def check_sequence_parallel_optimizer(engine: Any) -> None:
    """1-bit optimizers average over the data-parallel group only: the sequence ranks' weights would drift
    apart, so they are refused with sequence parallelism."""
    if engine.sequence_parallel_size > 1 and getattr(engine.basic_optimizer, "communicates_gradients", False):
        raise ConfigError(ConfigProblem("sequence_parallel_size", "1-bit optimizers (OneBitAdam, OneBitLamb, "
                                        "ZeroOneAdam) exchange gradients over the data-parallel group themselves "
                                        "and cannot sum them over the sequence ranks; accepted with a 1-bit "
                                        "optimizer: 1", engine.sequence_parallel_size))


def take_over_module(engine: Any, trained: set[int]) -> None:
    """A model wrapped again (a second Trainer on the same model object) still carries the first engine's
    gradient hooks, which would go on reducing every gradient into that engine's buffers: release the engines
    that train any of the same parameters (engines over disjoint parameters, one per optimizer, both train)."""
    engine._trained_ids = trained
    kept = []
    for ref in _TRAINERS_OF.get(engine.module, []):
        previous = ref()
        if previous is None or not previous._hook_handles:
            continue
        if previous._trained_ids & trained:
            log_dist("deepspeed.initialize: this model was already wrapped by another DeepSpeedEngine; that "
                     "engine is released (its gradient hooks removed) and can no longer train", ranks=[0],
                     level=logging.WARNING)
            previous._release("its model was wrapped by a newer DeepSpeedEngine")
        else:
            kept.append(ref)
    _TRAINERS_OF[engine.module] = [*kept, weakref.ref(engine)]


def add_checkpoint_shards(engine: Any) -> None:
    """The MoE experts' and the AutoTP-sharded layers' parts of ``engine.checkpoint_shards``."""
    if engine.has_moe_layers:
        from deepspeed.runtime.engine._autoep_checkpoint import AutoEPCheckpointShards, autoep_layers
        from deepspeed.runtime.engine._moe_checkpoint import MoECheckpointShards, _moe_layers

        moe = MoECheckpointShards(engine)  # native MoE layers' files; stage 0: every expert rank's optimizer
        if _moe_layers(engine.module) or moe.owns_optimizer_state:
            engine.checkpoint_shards = (*engine.checkpoint_shards, moe)
        if autoep_layers(engine.module):
            engine.checkpoint_shards = (*engine.checkpoint_shards, AutoEPCheckpointShards(engine))
    if engine.mp_world_size > 1:  # AutoTP-sharded layers: full weights in the checkpoints
        from deepspeed.runtime.autotp import checkpoint_shards

        engine.checkpoint_shards = checkpoint_shards(engine)
    if folding_spec_of(engine.module) is not None:  # AutoEP folded onto AutoTP: the layout in every file
        engine.checkpoint_shards = (*engine.checkpoint_shards, AutoEPFoldingCheckpointShards(engine))


def attach_features(engine: Any, config: Any, training_data: Any, collate_fn: Any) -> None:
    """What is attached once the optimizer and the training state exist: the data-efficiency schedules, the
    training loader, the monitor, the FLOPs profiler, the autotuning probe and ``torch.compile``."""
    _pld.attach(engine, config)
    _eigenvalue.attach(engine, config)
    bind_folding(engine)  # AutoEP folded onto AutoTP: the engine's and the ZeRO optimizer's view of the layout
    engine.data_efficiency = _data_efficiency.build(config, engine.train_batch_size(),
                                                    engine.train_micro_batch_size_per_gpu())
    engine.training_dataloader = (engine.deepspeed_io(training_data, collate_fn=collate_fn)
                                  if training_data is not None else None)
    if engine.training_dataloader is not None and hasattr(engine.optimizer, "set_steps_per_epoch"):
        engine.optimizer.set_steps_per_epoch(len(engine.training_dataloader))  # ZenFlow's epoch strategies
    engine.monitor = _reporting.build_monitor(config)
    engine.flops_profiler = _reporting.build_flops_profiler(engine.module, config, engine)
    engine.autotuning_probe = attach_autotuning_probe(engine, config.autotuning)  # writes metrics, then exits
    if config.compile.deepcompile:  # as in DeepSpeed, DeepCompile runs at engine.compile(); checked now
        from deepspeed.compile.engine import check_deepcompile

        check_deepcompile(config.compile)
    elif config.compile.enabled:
        engine.compile(backend=config.compile.backend)


def log_startup(engine: Any, config: Any) -> None:
    """DeepSpeed's start-up lines on rank 0: version and git revision, and the configuration with ``dump_state``."""
    from deepspeed import git_version_info

    log_dist(f"DeepSpeed info: version={__version__}, git-hash={git_version_info.git_hash}, "
             f"git-branch={git_version_info.git_branch}", ranks=[0])
    if config.dump_state:
        log_dist(f"DeepSpeedEngine configuration: {engine.config}", ranks=[0])
