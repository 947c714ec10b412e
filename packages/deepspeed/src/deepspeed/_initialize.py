"""``deepspeed.initialize`` and ``deepspeed.add_config_arguments``.

``initialize`` is a short composition: find the config -> initialise torch.distributed -> shard the model with
AutoTP when asked (AutoEP folded onto it just before, ``deepspeed.runtime.autoep``) -> find the data-parallel group
(``mpu``'s, else the world) -> parse the config for that group's size -> configure the comms logger -> build the
engine (which configures AutoEP, as DeepSpeed's does, and builds the optimizer wrapper, reducer, schedule, data
loader, monitors and profiler).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

_CONFLICT = ("deepspeed.initialize: the config was given both as {a} and as {b}; pass it once")


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config source among ``config``, its alias ``config_params`` and ``args.deepspeed_config``."""
    if config is not None and config_params is not None and config is not config_params:
        raise ValueError(_CONFLICT.format(a="config", b="config_params (its alias)"))
    source = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None and getattr(args, "deepscale_config", None) is not None:
        warnings.warn("--deepscale_config is deprecated, use --deepspeed_config", DeprecationWarning, stacklevel=3)
        from_args = args.deepscale_config
    if source is not None and from_args is not None:
        raise ValueError(_CONFLICT.format(a="an argument of deepspeed.initialize", b="args.deepspeed_config"))
    source = source if source is not None else from_args
    if source is None:
        raise ValueError("deepspeed.initialize: no DeepSpeed config: pass config=<dict or path> (or config_params), or "
                         "args with --deepspeed_config")
    return source


def _apply_mesh(mesh_param: Any, ds_config: Any) -> None:
    """``mesh_param=(dp, sp)``: DeepSpeed's (data_parallel, sequence_parallel) mesh, another way of giving the
    config's ``data_parallel_size`` and ``sequence_parallel_size``: the same groups (blocks of ``sp`` consecutive
    ranks share a sequence), so it sets those keys; values the config gives too must agree."""
    if mesh_param is None:
        return
    import torch.distributed as dist

    shape = tuple(mesh_param) if isinstance(mesh_param, (tuple, list)) else ()
    world = dist.get_world_size()
    if len(shape) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape) \
            or shape[0] * shape[1] != world:
        raise ValueError(f"deepspeed.initialize: mesh_param={mesh_param!r}: accepted: (data_parallel_size, "
                         f"sequence_parallel_size), two positive integers whose product is the world size ({world})")
    dp, sp = shape
    for key, value in (("data_parallel_size", dp), ("sequence_parallel_size", sp)):
        given = getattr(ds_config, key)
        if key in ds_config.model_fields_set and given is not None and given != value:
            raise ValueError(f"deepspeed.initialize: mesh_param={shape} gives {key} {value} but the config sets "
                             f"{key}: {given}; accepted: the same value in both, or the key left out")
    ds_config.data_parallel_size, ds_config.sequence_parallel_size = dp, sp


def _pipeline_module(model: Any) -> Any:
    """``model`` when it is a ``PipelineModule`` (trained by the ``PipelineEngine``), else None."""
    import sys

    module = sys.modules.get("ds_pipe.module")  # a PipelineModule instance means ds_pipe.module is imported
    return model if module is not None and isinstance(model, module.PipelineModule) else None


class MissingModelError(ValueError, AssertionError):
    """``deepspeed.initialize`` without a model: a ``ValueError``, and the ``AssertionError`` DeepSpeed raises."""


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Build the training engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    import torch.distributed as dist

    from deepspeed import comm
    from deepspeed.runtime.engine import DeepSpeedEngine
    from ds_config import load_config

    if model is None:  # also DeepSpeed's AssertionError (a model passed positionally lands in ``args``)
        raise MissingModelError("deepspeed.initialize: model is required (a torch.nn.Module); pass it as model=...")
    pipe = _pipeline_module(model)
    source = _config_source(args, config, config_params)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine_class: Any = DeepSpeedEngine
    if pipe is not None:
        from deepspeed.runtime.pipe.engine import PipelineEngine, pipeline_mpu

        mpu, engine_class = pipeline_mpu(pipe, mpu), PipelineEngine
    ds_config = load_config(source)
    _apply_mesh(mesh_param, ds_config)
    if pipe is None:  # AutoTP: shard the model, tensor/data groups as the mpu
        from deepspeed.runtime.autoep import fold_before_autotp
        from deepspeed.runtime.autotp import apply_autotp

        mpu, model_parameters, optimizer = apply_autotp(model, ds_config, mpu, model_parameters, optimizer,
                                                        before_shard=fold_before_autotp(model, ds_config))
    if ds_config.sequence_parallel_size > 1 or mpu is not None:  # sequence groups of the config's size
        from deepspeed.sequence.groups import sequence_mpu

        mpu = sequence_mpu(mpu, ds_config.sequence_parallel_size)
    if mpu is not None:
        from deepspeed.utils import groups

        groups.register_mpu(mpu)  # deepspeed.utils.groups' accessors read the same groups the engine uses
    dp_group = mpu.get_data_parallel_group() if mpu is not None else None
    dp_world = dist.get_world_size(dp_group) if dist.is_initialized() else 1
    ds_config.require_resolved()  # every key still "auto" in one error, before the batch arithmetic
    ds_config.resolve_batch(dp_world)
    if pipe is not None:
        ds_config.check_pipeline(pipe.num_stages)
    comm.configure(ds_config)
    if ds_config.hybrid_engine.enabled:
        engine_class = _hybrid_engine_class(engine_class)
    engine = engine_class(model, ds_config, optimizer=optimizer, model_parameters=model_parameters,
                          lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn, mpu=mpu)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _hybrid_engine_class(engine_class: type) -> type:
    """``hybrid_engine.enabled``: DeepSpeed-Chat's train/generate engine; a pipeline keeps its engine, as in
    DeepSpeed (which builds the pipeline engine first), and says that the section has no effect."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if engine_class is not DeepSpeedEngine:
        import warnings

        from ds_config.unbuilt import InertConfigKeyWarning

        warnings.warn("config key 'hybrid_engine' has no effect with a PipelineModule: the pipeline engine is "
                      "built, as DeepSpeed does", InertConfigKeyWarning, stacklevel=3)
        return engine_class
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    return DeepSpeedHybridEngine


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config``, deprecated ``--deepscale*``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
