"""``deepspeed.initialize`` and ``deepspeed.add_config_arguments``.

``initialize`` is a short composition: find the config -> initialise torch.distributed -> find the
data-parallel group (``mpu``'s, else the world) -> parse the config for that group's size -> configure the
comms logger -> build the engine (which builds the optimizer wrapper, reducer, schedule, data loader,
monitors and profiler).
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


def _check_mesh(mesh_param: Any) -> None:
    """``mesh_param=(dp, sp)``: only the pure data-parallel mesh is available in this version."""
    if mesh_param is None:
        return
    import torch.distributed as dist

    dp_size, sp_size = tuple(mesh_param)
    if sp_size != 1 or dp_size != dist.get_world_size():
        raise ValueError(f"deepspeed.initialize: mesh_param={tuple(mesh_param)}: only a pure data-parallel mesh "
                         f"(world size {dist.get_world_size()}, 1) is available in this version")


def _pipeline_module(model: Any) -> Any:
    """``model`` when it is a ``PipelineModule`` (trained by the ``PipelineEngine``), else None."""
    import sys

    module = sys.modules.get("ds_pipe.module")  # a PipelineModule instance means ds_pipe.module is imported
    return model if module is not None and isinstance(model, module.PipelineModule) else None


def _autoep_folding(ds_config: Any, mpu: Any) -> dict[str, Any] | None:
    """The arguments of ``apply_autoep_folded`` when AutoEP meets AutoTP's tensor-parallel groups, else None."""
    import torch.distributed as dist

    if mpu is None or not hasattr(mpu, "get_tensor_model_parallel_group") or not dist.is_initialized():
        return None
    tp_group = mpu.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) <= 1:
        return None
    zero = ds_config.zero_optimization
    return {"tp_group": tp_group, "dense_dp_group": mpu.get_data_parallel_group(), "zero_stage": ds_config.zero_stage,
            "deepcompile_enabled": bool(ds_config.compile.deepcompile),
            "tp_preset_model": ds_config.tensor_parallel.preset_model,
            "use_data_before_expert_parallel": bool(ds_config.use_data_before_expert_parallelism),
            "zero_offload_optimizer": _offloads(zero.offload_optimizer),
            "zero_offload_param": _offloads(zero.offload_param)}


def _offloads(section: Any) -> bool:
    device = getattr(section, "device", None)
    return getattr(device, "value", device) not in (None, "none")


def _folder(model: Any, ds_config: Any) -> Any:
    """AutoTP's ``before_shard`` step when AutoEP is enabled too: fold AutoEP onto the tensor-parallel ranks
    (``ds_moe.autoep.folded``) before AutoTP shards, so AutoTP leaves the AutoEP layers (router, experts) alone."""
    if not ds_config.expert_parallel.enabled:
        return None

    def fold(tp_mpu: Any) -> None:
        from ds_moe.autoep import as_autoep_config
        from ds_moe.autoep.folded import apply_autoep_folded

        folding = _autoep_folding(ds_config, tp_mpu)
        if folding is not None:
            apply_autoep_folded(model, as_autoep_config(ds_config.expert_parallel), **folding)

    return fold


def _apply_autoep(model: Any, section: Any, model_parameters: Any, optimizer: Any,
                  data_first: bool = False) -> tuple[Any, Any]:
    """AutoEP: the model's Hugging Face MoE blocks become expert-parallel layers; a parameter list or a client
    optimizer taken from the unconverted model is pointed at the new expert tensors (as DeepSpeed rewires them).
    Folded onto AutoTP (done before AutoTP sharded, :func:`_folder`): the parameters AutoTP made get their
    gradient corrections too."""
    import torch

    from ds_moe.autoep import apply_autoep, remap_parameters
    from ds_moe.autoep.folded import hook_new_parameters

    if not hook_new_parameters(model):
        apply_autoep(model, section, use_data_before_expert_parallel=data_first)  # the engine's group order
    if isinstance(model_parameters, (list, tuple)):
        model_parameters = remap_parameters(model_parameters, model)
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = remap_parameters(group["params"], model)
    return model_parameters, optimizer


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
    _check_mesh(mesh_param)
    engine_class: Any = DeepSpeedEngine
    if pipe is not None:
        from deepspeed.runtime.pipe.engine import PipelineEngine, pipeline_mpu

        mpu, engine_class = pipeline_mpu(pipe, mpu), PipelineEngine
    ds_config = load_config(source)
    if pipe is None:  # AutoTP: shard the model, tensor/data groups as the mpu
        from deepspeed.runtime.autotp import apply_autotp

        mpu, model_parameters, optimizer = apply_autotp(model, ds_config, mpu, model_parameters, optimizer,
                                                        before_shard=_folder(model, ds_config))
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
    if ds_config.expert_parallel.enabled:
        model_parameters, optimizer = _apply_autoep(model, ds_config.expert_parallel, model_parameters, optimizer,
                                                    ds_config.use_data_before_expert_parallelism)
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
