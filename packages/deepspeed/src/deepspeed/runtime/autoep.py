"""AutoEP (the ``expert_parallel`` section) configured for a run: DeepSpeed's ``_configure_expert_parallel`` step.

The engine runs it (``DeepSpeedEngine._configure_expert_parallel``) before it casts and places the module.
AutoEP folded onto AutoTP (``tensor_parallel.autotp_size > 1``) needs it earlier as well: ``deepspeed.initialize``
runs it (:func:`fold_before_autotp`) just before AutoTP shards the model, because AutoTP leaves AutoEP's layers
(router, routed experts) to expert parallelism and shards only their shared experts, so the layers must exist
by then.

The step, in DeepSpeed's order: refuse tensor model parallelism from a client mpu; check the section against the
run's sizes (world, pipeline, tensor, sequence) and the folded layout against the run's features (ZeRO stage,
offload, DeepCompile, rank order, presets), all before any group exists (``ValueError`` naming the key); detect the
MoE blocks; create the ``ep_size_<n>`` expert and expert-data groups (folded onto the tensor-parallel ranks when
AutoTP is on); replace the blocks. Collective: every rank, in the same order. Running it again on the same model is
harmless, which is what the engine does after ``initialize`` folded: existing groups are checked against the
layout, replaced blocks are not detected again, and only the parameters made since (AutoTP's shards) get the
folded gradient corrections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed.utils import groups
from deepspeed.utils.logging import logger
from ds_moe.autoep import as_autoep_config, remap_parameters
from ds_moe.autoep import config as autoep_config
from ds_moe.autoep import detect as autoep_detect
from ds_moe.autoep.folded import apply_autoep_folded
from ds_moe.autoep.folding import ParallelFoldingSpec, build_folding_spec, validate_folding_global
from ds_moe.ep_repack import gather_source_zero_params


@dataclass(frozen=True)
class AutoEPRun:
    """What the ``expert_parallel`` section (``config``, an ``AutoEPConfig``) is checked against and laid out by:
    the tensor (AutoTP) and sequence parallel sizes, the model-parallel unit, and the features folding refuses."""

    config: Any
    tp_size: int = 1
    sp_size: int = 1
    mpu: Any = None
    zero_stage: int = 0
    zero_offload_optimizer: bool = False
    zero_offload_param: bool = False
    deepcompile: bool = False
    use_data_before_expert_parallel: bool = False
    tp_preset_model: str | None = None


def world_size() -> int | None:
    """The world size of torch.distributed's default group; None in a process without one."""
    try:
        return dist.get_world_size()
    except ValueError:  # torch: "Default process group has not been initialized"
        return None


def refuse_client_tensor_parallel(mpu: Any, tp_size: int) -> None:
    """Tensor model parallelism from a client mpu (Megatron's) is not AutoEP's: only AutoTP's folds."""
    if mpu is None or tp_size > 1:
        return  # with AutoTP the mpu's tensor groups are AutoTP's (validate_folding_global checks the sizes)
    mpu_tp = groups.bwc_tensor_model_parallel_world_size(mpu)
    if mpu_tp != 1:
        raise ValueError(f"expert_parallel.enabled: AutoEP does not support tensor model parallelism from the mpu "
                         f"(bwc_tensor_model_parallel_world_size={mpu_tp}); disable the mpu's tensor parallelism, "
                         "or use AutoTP (tensor_parallel.autotp_size), onto which AutoEP folds")


def check_expert_parallel(run: AutoEPRun, world: int | None) -> tuple[ParallelFoldingSpec, int]:
    """Every check that needs no group, in DeepSpeed's order (``ValueError`` naming the key); the layout and the
    pipeline-parallel size. ``world``: :func:`world_size`."""
    config, tp_size = run.config, max(int(run.tp_size or 1), 1)
    refuse_client_tensor_parallel(run.mpu, tp_size)
    pp_size = groups.bwc_pipeline_parallel_world_size(run.mpu) if run.mpu is not None else 1
    if world is None and config.autoep_size > 1:
        raise RuntimeError(f"expert_parallel.autoep_size={config.autoep_size} needs torch.distributed initialised "
                           "(deepspeed.init_distributed, or deepspeed.initialize) before the engine is built")
    world = world or 1
    autoep_config.validate_autoep_config(config, world, pp_size, tp_size, run.sp_size)
    spec = build_folding_spec(world_size=world, pp_size=pp_size, tp_size=tp_size, ep_size=config.autoep_size,
                              etp_size=config.expert_tensor_parallel_size, mp_mode="tp" if tp_size > 1 else "sp")
    validate_folding_global(spec, zero_stage=run.zero_stage, sp_size=run.sp_size, deepcompile_enabled=run.deepcompile,
                            use_data_before_expert_parallel=run.use_data_before_expert_parallel, mpu=run.mpu,
                            autoep_enabled=config.enabled, tp_preset=run.tp_preset_model,
                            ep_preset=config.preset_model, zero_offload_optimizer=run.zero_offload_optimizer,
                            zero_offload_param=run.zero_offload_param)
    return spec, pp_size


def configure_expert_parallel(model: torch.nn.Module, run: AutoEPRun) -> ParallelFoldingSpec | None:
    """Check, create the expert groups and replace ``model``'s MoE blocks by AutoEP layers (in place). Returns the
    folded layout (None: AutoEP is off or not folded)."""
    config = run.config
    if config is None or not config.enabled:
        return None
    world = world_size()
    spec, pp_size = check_expert_parallel(run, world)
    if spec.tp_size > 1:
        _fold(model, config, spec, run.mpu)
        return spec
    auto_ep = autoep_detect.AutoEP(model, config)
    specs = auto_ep.ep_parser()  # before any group: a model that does not fit fails without a collective
    autoep_config.validate_autoep_post_detection(config, specs)
    group, rank = _expert_group(config.autoep_size, pp_size, run, world)
    if specs:
        # a model built under zero.Init: each MoE block's partitioned weights are gathered (read only) while its
        # AutoEP layer copies them; the new layer's parameters are whole (the engine partitions them)
        sources = [p for layer in specs for p in model.get_submodule(layer.moe_module_name).parameters()]
        with gather_source_zero_params(sources):
            auto_ep.replace_moe_layers(specs, config.autoep_size, rank)
        for layer in specs:
            model.get_submodule(layer.moe_module_name).ep_group = group
        logger.info(f"AutoEP: replaced {len(specs)} MoE layer(s) with ep_size={config.autoep_size}")
    return None


def _expert_group(ep_size: int, pp_size: int, run: AutoEPRun, world: int | None) -> tuple[Any, int]:
    """The ``ep_size_<ep_size>`` groups, created (collective; a no-op for existing ones) with the sequence ranks as
    DeepSpeed's ``"sp"`` model-parallel mode; this rank's expert group and its rank in it."""
    if world is None:
        return None, 0  # one process without torch.distributed: autoep_size is 1 (check_expert_parallel)
    groups._create_expert_and_data_parallel(expert_parallel_size_=ep_size, mp_size=max(run.sp_size, 1),
                                            pp_size=pp_size, mp_mode="sp",
                                            use_data_before_expert_parallel_=run.use_data_before_expert_parallel)
    group = groups._get_expert_parallel_group(f"ep_size_{ep_size}")
    return group, dist.get_rank(group=group)


def _fold(model: torch.nn.Module, config: Any, spec: ParallelFoldingSpec, mpu: Any) -> None:
    """AutoEP folded onto AutoTP's tensor-parallel and dense data-parallel groups (the mpu's)."""
    if mpu is None or not hasattr(mpu, "get_tensor_model_parallel_group"):
        raise ValueError(f"tensor_parallel.autotp_size={spec.tp_size} with expert_parallel: folding AutoEP onto "
                         "AutoTP needs AutoTP's tensor-parallel groups; build the engine with deepspeed.initialize, "
                         "which creates them")
    apply_autoep_folded(model, config, tp_group=mpu.get_tensor_model_parallel_group(),
                        dense_dp_group=mpu.get_data_parallel_group())


def run_from_config(ds_config: Any, mpu: Any, tp_size: int, sp_size: int = 1) -> AutoEPRun:
    """The :class:`AutoEPRun` of a typed ``ds_config.DeepSpeedConfig``."""
    zero = ds_config.zero_optimization
    return AutoEPRun(config=as_autoep_config(ds_config.expert_parallel), tp_size=tp_size, sp_size=sp_size, mpu=mpu,
                     zero_stage=ds_config.zero_stage, zero_offload_optimizer=offloads(zero.offload_optimizer),
                     zero_offload_param=offloads(zero.offload_param), deepcompile=bool(ds_config.compile.deepcompile),
                     use_data_before_expert_parallel=bool(ds_config.use_data_before_expert_parallelism),
                     tp_preset_model=ds_config.tensor_parallel.preset_model)


def offloads(section: Any) -> bool:
    """Whether a ZeRO ``offload_optimizer`` / ``offload_param`` section moves anything (device not none)."""
    device = getattr(section, "device", None)
    return getattr(device, "value", device) not in (None, "none")


def fold_before_autotp(model: torch.nn.Module, ds_config: Any) -> Callable[[Any], None] | None:
    """``apply_autotp``'s ``before_shard`` step when ``expert_parallel`` is enabled: fold AutoEP onto the
    tensor-parallel ranks before AutoTP shards (None: AutoEP is off)."""
    if not ds_config.expert_parallel.enabled:
        return None

    def fold(tp_mpu: Any) -> None:
        tp_size = dist.get_world_size(tp_mpu.get_tensor_model_parallel_group())
        if tp_size > 1:
            configure_expert_parallel(model, run_from_config(ds_config, tp_mpu, tp_size,
                                                             ds_config.sequence_parallel_size))

    return fold


def remap_client_parameters(model: torch.nn.Module, model_parameters: Any, optimizer: Any) -> tuple[Any, Any]:
    """A parameter list or a client optimizer taken from the model before AutoEP replaced its MoE blocks, pointed
    at the AutoEP layers' expert tensors (as DeepSpeed rewires them)."""
    if isinstance(model_parameters, (list, tuple)):
        model_parameters = remap_parameters(model_parameters, model)
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = remap_parameters(group["params"], model)
    return model_parameters, optimizer
