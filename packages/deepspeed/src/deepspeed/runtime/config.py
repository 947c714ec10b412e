"""DeepSpeed's ``deepspeed.runtime.config``: the ``DeepSpeedConfig(config, mpu=None, mesh_device=None)`` class
client code constructs from a JSON path or a dict, the optimizer-name constants, and the config key constants.

The class is a thin view over the typed ``ds_config.DeepSpeedConfig`` (what the engine uses): it parses the
config with the schema (same ``ConfigError``, naming each bad key's full path), resolves the batch arithmetic for
the data-parallel world size, and exposes the attribute names DeepSpeed's class has (``train_batch_size``,
``zero_config``, ``fp16_enabled``, ``optimizer_params``, ...) for the features this version provides. The typed
config it was built from is ``typed_config``. Every other name of ``ds_config.config`` stays importable here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from deepspeed.runtime.constants import *  # noqa: F403 -- DeepSpeed's module star-exports its constants too
from deepspeed.runtime.constants import FP16_INITIAL_SCALE_POWER_DEFAULT, FP16_LOSS_SCALE_DEFAULT, ValidationMode
from ds_config import ConfigError as DeepSpeedConfigError  # noqa: F401 - the same class as deepspeed.DeepSpeedConfigError
from ds_config import DeepSpeedConfig as TypedDeepSpeedConfig
from ds_config import DeepSpeedMonitorConfig, load_config, read_source, resolve_batch_sizes, torch_dtype_name
from ds_config.config import *  # noqa: F403 -- ds_config.config's names stay reachable at this path
from ds_config.config_utils import ScientificNotationEncoder, dict_raise_error_on_duplicate_keys

TENSOR_CORE_ALIGN_SIZE = 8

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
]
"""Optimizer types DeepSpeed builds itself (matched case-insensitively); other names come from ``torch.optim``."""

TORCH_ADAM_PARAM = "torch_adam"
"""Adam/AdamW parameter: use ``torch.optim.Adam(W)`` instead of DeepSpeed's fused Adam."""

ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
"""Adam/AdamW parameter: decoupled weight decay (AdamW), on unless turned off."""


class BatchConfigError(DeepSpeedConfigError, AssertionError):
    """Inconsistent batch sizes from ``DeepSpeedConfig._configure_train_batch_size``: a ``ConfigError`` (naming the
    keys and the equation) that is also an ``AssertionError``, the type DeepSpeed's method raises and its callers
    catch."""


class DeepSpeedConfig:
    """DeepSpeed's config object: ``DeepSpeedConfig("ds_config.json")`` or ``DeepSpeedConfig(config_dict, mpu)``.

    ``config``: a dict (kept as ``_param_dict``, not copied), a path to a JSON file, JSON text or base64 JSON.
    The data-parallel world size comes from ``mpu.get_data_parallel_world_size()`` when an mpu is given, else
    from the ``data_parallel`` group of ``mesh_device`` or the ``torch.distributed`` world when it is
    initialised, else 1. Raises ``ConfigError`` (a ``ValueError``) for a config the schema rejects.
    """

    def __init__(self, config: str | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict: dict[str, Any] = config if isinstance(config, dict) else read_source(config)
        sp = self._param_dict.get("sequence_parallel_size", 1)  # validated by load_config below
        self.global_rank, self.world_size = _rank_and_data_parallel_size(mpu, mesh_device,
                                                                         sp if isinstance(sp, int) and sp > 0 else 1)
        self.typed_config: TypedDeepSpeedConfig = load_config(self._param_dict, world_size=self.world_size)
        self._initialize_params(self.typed_config)

    def _initialize_params(self, typed: TypedDeepSpeedConfig) -> None:
        for part in (_batch, _communication, _zero, _precision, _optimization, _logging, _checkpointing,
                     _expert_parallel):
            self.__dict__.update(part(typed))

    def _configure_train_batch_size(self) -> None:
        """Re-derive the batch triple from the ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
        ``gradient_accumulation_steps`` attributes as they are now (None: not given) for this data-parallel size,
        as DeepSpeed's method does; raises ``BatchConfigError`` when they do not fit together."""
        try:
            sizes = resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                        self.gradient_accumulation_steps, world_size=self.world_size)
        except DeepSpeedConfigError as exc:
            raise BatchConfigError(exc.problems) from None
        self.__dict__.update(sizes.as_dict())

    def print_user_config(self) -> None:
        """Log the config as the user gave it."""
        from deepspeed.utils import logger

        text = json.dumps(self._param_dict, sort_keys=True, indent=4, cls=ScientificNotationEncoder,
                          separators=(",", ":"))
        logger.info(f"  json = {text}")

    def print(self, name: str) -> None:
        """Log every attribute (dotted to one column) under the heading ``name``, then the user's config."""
        from deepspeed.utils import logger

        logger.info(f"{name}:")
        for arg in sorted(vars(self)):
            if not arg.startswith("_") and arg != "typed_config":
                logger.info(f"  {arg} {'.' * (29 - len(arg))} {getattr(self, arg)}")
        self.print_user_config()


class DeepSpeedConfigWriter:
    """Build a config file from a template: ``add_config`` keys, ``load_config``/``write_config`` JSON files."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = data if data is not None else {}

    def add_config(self, key: str, value: Any) -> None:
        self.data[key] = value

    def load_config(self, filename: str) -> None:
        with open(filename, encoding="utf-8") as f:
            self.data = json.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)

    def write_config(self, filename: str) -> None:
        with open(filename, "w", encoding="utf-8") as f:
            json.dump(self.data, f)


def _rank_and_data_parallel_size(mpu: Any, mesh_device: Any, sequence_parallel_size: int = 1) -> tuple[int, int]:
    """(global rank, data-parallel world size) as DeepSpeed derives them; rank 0 and size 1 without a process
    group. ``torch.distributed`` is only consulted when already imported (it cannot be initialised otherwise).
    Without an mpu or mesh, the config's ``sequence_parallel_size`` ranks share each sample."""
    dist = sys.modules.get("torch.distributed")
    ready = dist is not None and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if ready else 0
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return rank, int(mpu.get_data_parallel_world_size())
    if not ready:
        return rank, 1
    if mpu is not None:  # Ulysses sequence parallelism: every rank outside the sequence group is data parallel
        return rank, dist.get_world_size() // int(mpu.get_sequence_parallel_world_size())
    if mesh_device is not None:
        return rank, dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    return rank, max(dist.get_world_size() // sequence_parallel_size, 1)


def _torch_dtype(short: str | None) -> Any:
    if short is None:
        return None
    import torch

    return getattr(torch, torch_dtype_name(short))


def _given(section: Any, key: str) -> bool:
    return section is not None and key in section.model_fields_set


def _batch(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    sizes = typed.batch
    return {"train_batch_size": sizes.train_batch_size,
            "train_micro_batch_size_per_gpu": sizes.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": sizes.gradient_accumulation_steps,
            "elasticity_enabled": typed.elasticity.enabled,
            "dataloader_drop_last": typed.dataloader_drop_last,
            "managed_gradient_accumulation": typed.managed_gradient_accumulation}


def _communication(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    return {"disable_allgather": typed.disable_allgather,
            "communication_data_type": _torch_dtype(typed.communication_data_type),
            "seq_parallel_communication_data_type": _torch_dtype(typed.seq_parallel_communication_data_type),
            "prescale_gradients": typed.prescale_gradients,
            "gradient_predivide_factor": typed.gradient_predivide_factor,
            "sparse_gradients_enabled": typed.sparse_gradients,
            "gradient_allreduce_op": typed.gradient_allreduce_op,
            "use_data_before_expert_parallel_": typed.use_data_before_expert_parallelism,
            "comms_config": SimpleNamespace(comms_logger_enabled=typed.comms_logger.enabled,
                                            comms_logger=typed.comms_logger)}


def _zero(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    zero = typed.zero_optimization
    return {"zero_config": zero, "zero_optimization_stage": int(zero.stage), "zero_enabled": int(zero.stage) > 0,
            "mics_shard_size": zero.mics_shard_size,
            "mics_hierarchial_params_gather": zero.mics_hierarchical_params_gather,  # DeepSpeed's spelling
            "zero_allow_untested_optimizer": typed.zero_allow_untested_optimizer,
            "zero_force_ds_cpu_optimizer": typed.zero_force_ds_cpu_optimizer,
            "aio_config": typed.aio.model_dump()}


def _precision(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    """The precision attributes, with DeepSpeed's values when a mode is off (``loss_scale`` 1.0 under bf16, ...)."""
    fp16, bf16, autocast = typed.fp16, typed.bf16, typed.torch_autocast
    dynamic_keys = ("initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis",
                    "consecutive_hysteresis")
    if fp16.enabled:
        loss_scale, initial = fp16.loss_scale, fp16.initial_dynamic_scale()
    else:
        loss_scale = 1.0 if bf16.enabled else FP16_LOSS_SCALE_DEFAULT
        initial = 1 if bf16.enabled else 2**FP16_INITIAL_SCALE_POWER_DEFAULT
    return {"float16_config": fp16, "bfloat16_config": bf16,
            "fp16_enabled": fp16.enabled, "bfloat16_enabled": bf16.enabled,
            "fp16_auto_cast": fp16.auto_cast if fp16.enabled else None,
            "fp16_master_weights_and_gradients": fp16.enabled and fp16.fp16_master_weights_and_grads,
            "bfloat16_immediate_grad_update": bf16.immediate_grad_update,
            "loss_scale": loss_scale, "initial_dynamic_scale": initial,
            "dynamic_loss_scale_args": (fp16.dynamic_loss_scale_args()
                                        if fp16.enabled and any(_given(fp16, k) for k in dynamic_keys) else None),
            "amp_enabled": typed.amp.enabled,
            "amp_params": typed.amp.apex_kwargs() if "amp" in typed.model_fields_set else False,
            "torch_autocast_enabled": autocast.enabled,
            "torch_autocast_dtype": _torch_dtype(autocast.dtype) if _given(autocast, "dtype") else None,
            "torch_autocast_lower_precision_safe_modules": autocast.lower_precision_safe_modules,
            "grad_accum_dtype": typed.data_types.grad_accum_dtype,
            "param_dtype": typed.data_types.param_dtype, "buffer_dtype": typed.data_types.buffer_dtype,
            "graph_harvesting": typed.graph_harvesting}


def _optimization(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    opt, sched = typed.optimizer, typed.scheduler
    return {"gradient_clipping": typed.gradient_clipping,
            "optimizer_name": opt.name if opt is not None else None,
            "optimizer_params": opt.params.given() if _given(opt, "params") else None,
            "optimizer_legacy_fusion": opt.legacy_fusion if opt is not None else False,
            "scheduler_name": sched.type if sched is not None else None,
            "scheduler_params": _scheduler_params(sched) if _given(sched, "params") else None,
            # DeepSpeed's dict: its six defaults plus the keys the user gave (use_reentrant only when given)
            "pipeline": typed.pipeline.model_dump(exclude=None if "use_reentrant" in typed.pipeline.model_fields_set
                                                  else {"use_reentrant"}),
            "activation_checkpointing_config": typed.activation_checkpointing}


def _scheduler_params(sched: Any) -> dict[str, Any]:
    params = sched.params
    if isinstance(params, Mapping):
        return dict(params)
    return {k: getattr(params, k) for k in params.model_fields_set}  # as written, like DeepSpeed's raw dict


def _logging(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    return {"steps_per_print": typed.steps_per_print, "dump_state": typed.dump_state,
            "wall_clock_breakdown": typed.wall_clock_breakdown or typed.flops_profiler.enabled,
            "memory_breakdown": typed.memory_breakdown, "log_level": typed.log_level,
            "timers_config": typed.timers.throughput, "hybrid_engine": typed.hybrid_engine,
            "flops_profiler_config": typed.flops_profiler,
            "monitor_config": DeepSpeedMonitorConfig.model_construct(
                tensorboard=typed.tensorboard, comet=typed.comet, wandb=typed.wandb, csv_monitor=typed.csv_monitor)}


def _checkpointing(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    ckpt = typed.checkpoint
    mode = ckpt.tag_validation.upper()
    return {"checkpoint_tag_validation_enabled": mode != ValidationMode.IGNORE,
            "checkpoint_tag_validation_fail": mode == ValidationMode.FAIL,
            "load_universal_checkpoint": ckpt.load_universal,
            "use_node_local_storage": ckpt.use_node_local_storage,
            "checkpoint_parallel_write_pipeline": ckpt.parallel_write.pipeline_stage,
            "checkpoint_config": {"tag_validation": mode, "checkpoint_serialization": ckpt.checkpoint_serialization,
                                  "writer": None if ckpt.writer is None else ckpt.writer.model_dump()},
            "nebula_config": typed.nebula, "weight_quantization_config": typed.weight_quantization}


def _expert_parallel(typed: TypedDeepSpeedConfig) -> dict[str, Any]:
    """DeepSpeed's ``expert_parallel_config``: the AutoEP section as an ``AutoEPConfig`` (which keys were given,
    e.g. ``_load_balance_coeff_explicit``)."""
    from ds_moe.autoep import as_autoep_config

    return {"expert_parallel_config": as_autoep_config(typed.expert_parallel)}


def get_gradient_clipping(param_dict: Mapping[str, Any]) -> float:
    """The raw config dict's ``gradient_clipping`` (0.0, no clipping, when absent)."""
    return param_dict.get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)  # noqa: F405 - from runtime.constants


def get_log_level(param_dict: Mapping[str, Any]) -> str | None:
    """The raw config dict's ``log_level`` (None when absent: the logger keeps its level)."""
    return param_dict.get(LOG_LEVEL, LOG_LEVEL_DEFAULT)  # noqa: F405
