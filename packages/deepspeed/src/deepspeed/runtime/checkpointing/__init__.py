"""Training checkpoints in DeepSpeed's layout, written atomically and collectively.

The engine delegates its three methods here, passing an :class:`EngineState` bundle::

    from deepspeed.runtime import checkpointing as ckpt

    state = ckpt.EngineState(
        module=self.module,                       # nn.Module
        optimizer=self.optimizer,                 # state_dict()/load_state_dict(), or None
        lr_scheduler=self.lr_scheduler,           # same, or None
        counters=self,                            # anything with global_steps, global_samples, micro_steps,
                                                  #   skipped_steps (default ckpt.TrainingCounters());
                                                  #   load sets them in place
        checkpoint_config=config.checkpoint,      # ds_config.checkpoint.CheckpointConfig
        ds_config=config_dict,                    # the JSON-like config dict, saved under "ds_config"
        parallel=ckpt.ParallelInfo(global_rank=..., local_rank=..., dp_rank=..., dp_world_size=...,
                                   dp_group=..., mp_rank=0, mp_world_size=1),
        sync=ckpt.SyncOptions(group=None, timeout_s=None),   # who meets at a save/load; see _sync
        shards=(),                                # ckpt.CheckpointShards extensions (ZeRO, pipeline)
        data_sampler=None, random_ltd=None,       # data efficiency (curriculum sampler, random-LTD), or None
    )
    tag_dir = ckpt.save_checkpoint(state, save_dir, tag=None, client_state={}, save_latest=True,
                                   exclude_frozen_parameters=False)
    path, client_state = ckpt.load_checkpoint(state, load_dir, tag=None, load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=True,
                                              load_module_only=False, custom_load_fn=None)
    ckpt.save_16bit_model(module, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False)

An engine may also pass itself where a state is expected (``save_checkpoint(self, ...)``): :func:`as_engine_state`
reads DeepSpeed's public engine attributes (module, optimizer, lr_scheduler, the counters, ``config`` dict,
global_rank, local_rank, dp_group, dp_world_size), the typed ``_config.checkpoint`` and, if present,
``mp_rank``, ``mp_world_size`` and ``checkpoint_shards``; the counters are then set on the engine on load.
``save_16bit_model(engine, ...)`` saves ``engine.module``'s weights (unprefixed keys, as DeepSpeed does).

Files: ``<dir>/<tag>/mp_rank_XX_model_states.pt`` holds DeepSpeed's keys (module, buffer_names, optimizer,
param_shapes, frozen_param_shapes, shared_params, frozen_param_fragments, lr_scheduler, data_sampler,
random_ltd, sparse_tensor_module_names, skipped_steps, global_steps, global_samples, dp_world_size,
mp_world_size, ds_config, ds_version; plus micro_steps) with the client state merged at the top level;
``<dir>/latest`` holds the tag (default ``global_step<N>``). ``CheckpointShards`` extensions add per-rank files
such as ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (:func:`zero_optim_states_name`); one that sets
``owns_optimizer_state`` makes the model-states file store ``optimizer: None`` and loads the optimizer itself.

Behaviour:
- Config ``checkpoint``: ``tag_validation`` Ignore/Warn/Fail (do all ranks pass the same tag?);
  ``load_universal`` loads a ``ds_to_universal`` folder (``deepspeed.checkpoint.universal``) onto any data-parallel
  world size and ZeRO stage, each rank reading only its slices; ``use_node_local_storage`` makes local
  rank 0 of every node write the model states and ``latest``; ``parallel_write.pipeline_stage`` spreads a
  stage's ``layer_XX-model_YY-model_states.pt`` files over its data-parallel ranks (:class:`PipelineLayerShards`,
  :func:`pipeline_layer_range`).
- AutoTP (``tensor_parallel.autotp_size``) files hold the full weights, so they load at another TP size (a rank
  whose ``mp_rank_XX`` file a smaller TP size never wrote reads ``mp_rank_00``); optimizer states only at the
  saved size: otherwise :class:`CheckpointError` before anything is loaded, naming both sizes (``tp_resize``).
- Atomic: every rank writes its files under temporary names (fsynced); only when every rank's writes succeeded
  are they renamed into place (directories fsynced), and ``latest`` is written last, by rank 0. A crash or a
  write error (ENOSPC, EACCES, EIO) on any rank mid-save leaves the previous files of the tag and ``latest``
  intact.
- Collective-safe: ranks meet in the process group's store with a timeout; a save called on some ranks only
  raises :class:`CheckpointSyncError` naming the ranks that did not arrive (``DS_CHECKPOINT_TIMEOUT`` s).
- Agreed failures: a load reads and checks every file each rank needs (unpickling, keys, shapes against the
  live model and partitions) before any rank changes anything or enters a collective; then the ranks agree,
  and a failure anywhere raises the same :class:`CheckpointRankError` on every rank, naming the rank, the file
  and the cause (message format: ``_agreement``). A save agrees the same way after writing.
- Loading uses ``torch.load(weights_only=True)`` (``EngineState.trusted_load`` opts out); an unreadable file
  raises :class:`CorruptCheckpointError` naming it and why (empty, truncated, not a checkpoint file), with one
  rank; with several, the :class:`CheckpointRankError` above. No ``latest`` (and no tag), or no model-states
  file: a warning and ``(None, None)``.
"""

from deepspeed.runtime.checkpointing._engine_adapter import as_engine_state
from deepspeed.runtime.checkpointing._load import load_checkpoint
from deepspeed.runtime.checkpointing._pipeline import PipelineLayerShards
from deepspeed.runtime.checkpointing._save import model_states, save_checkpoint
from deepspeed.runtime.checkpointing._sixteen_bit import save_16bit_model
from deepspeed.runtime.checkpointing._state import (
    CheckpointShards,
    Counters,
    EngineState,
    ParallelInfo,
    ShardContext,
    Stateful,
    SyncOptions,
    TrainingCounters,
)
from deepspeed.runtime.checkpointing.errors import (
    CheckpointError,
    CheckpointRankError,
    CheckpointSyncError,
    CheckpointTagError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from deepspeed.runtime.checkpointing.layout import (
    LATEST_FILE,
    default_tag,
    layer_states_name,
    model_states_name,
    pipeline_layer_range,
    read_latest,
    zero_optim_states_name,
)
from deepspeed.runtime.checkpointing.serialize import load_file, save_file

__all__ = [
    "LATEST_FILE",
    "CheckpointError",
    "CheckpointRankError",
    "CheckpointShards",
    "CheckpointSyncError",
    "CheckpointTagError",
    "Counters",
    "CorruptCheckpointError",
    "EngineState",
    "ParallelInfo",
    "PipelineLayerShards",
    "ShardContext",
    "Stateful",
    "SyncOptions",
    "TrainingCounters",
    "UnsafeCheckpointError",
    "as_engine_state",
    "default_tag",
    "layer_states_name",
    "load_checkpoint",
    "load_file",
    "model_states",
    "model_states_name",
    "pipeline_layer_range",
    "read_latest",
    "save_16bit_model",
    "save_checkpoint",
    "save_file",
    "zero_optim_states_name",
]
