"""ZeRO stage 3 for the engine: partition the model (the model transform of ``initialize``), build the ZeRO-3
optimizer wrapper and its reduce-scatter from ``zero_optimization``, and the engine methods that exist for ZeRO-3
(``Zero3EngineMethods``, a mixin of ``DeepSpeedEngine``: releasing the gathered weights, and consolidating the
partitioned weights into one 16-bit state dict for ``save_16bit_model`` and the Hugging Face / Accelerate save).

Every documented ``zero_optimization`` field is either honoured by ds-zero or rejected here with the reason
(NVMe offload comes with ZeRO-Infinity; ZeRO++ and MiCS are ``ds_zero.zeropp``; ZenFlow and the legacy stage 1
are not available).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from deepspeed import comm
from deepspeed.runtime.engine._moe import MoEWithZeroStage3
from deepspeed.runtime.engine._precision import comm_dtype, grad_accum_fp32, loss_scaler
from deepspeed.runtime.engine._stages import StageInputs
from deepspeed.runtime.engine._zero import offload_pinning, zero_plus_plus_problems
from deepspeed.runtime.optimizer_wrapper import GradientReducer, OptimizerWrapper
from ds_config import ConfigError, ConfigProblem


def _problem(key: str, why: str, value: Any) -> ConfigProblem:
    return ConfigProblem(f"zero_optimization.{key}", why, value)


def _unsupported(config: Any, mpu: Any, module: torch.nn.Module) -> list[ConfigProblem]:
    zero = config.zero_optimization
    later = "is part of ZeRO-Infinity/ZeRO++/MiCS, not available in this version; accepted here"
    problems = []
    off = zero.offload_optimizer  # device nvme: ZeRO-Infinity (ds_zero.swap), ratio: the share of it on NVMe
    if off is not None and float(off.ratio) != 1.0 and not str(off.device).endswith("nvme"):
        problems.append(_problem("offload_optimizer.ratio", "partial offload is the share of the sub-groups on "
                                 "NVMe (device nvme); accepted with device cpu: 1.0", off.ratio))
    if off is not None and off.super_offload:
        problems.append(_problem("offload_optimizer.super_offload", "SuperOffload is not available in this "
                                 "version; accepted: false", True))
    # ZeRO++ and MiCS are honoured at stage 3 (ds_zero.zeropp); of that list only ZenFlow is not available
    problems += [p for p in zero_plus_plus_problems(zero, later) if p.path.endswith(".zenflow")]
    if zero.legacy_stage1:
        problems.append(_problem("legacy_stage1", "a stage 1 option; accepted with stage 3: false", True))
    pipe = mpu.get_pipe_parallel_world_size() if mpu is not None and hasattr(mpu, "get_pipe_parallel_world_size") \
        else 1
    if pipe > 1 or type(module).__name__ == "PipelineModule":
        problems.append(_problem("stage", "ZeRO stage 3 partitions parameters across the data-parallel group and "
                                 "cannot be combined with pipeline parallelism; accepted with a pipeline: 0 or 1", 3))
    if config.amp_enabled:
        problems.append(ConfigProblem("amp.enabled", "NVIDIA Apex AMP is not available with ZeRO; use \"bf16\" or "
                                      "\"fp16\"", True))
    return problems


def _schedule_settings(zero: Any) -> Any:
    from ds_zero.zero3.schedule import ScheduleSettings

    return ScheduleSettings(
        prefetch_bucket_numel=int(zero.prefetch_bucket_size), max_live_numel=int(zero.max_live_parameters),
        max_reuse_distance=int(zero.max_reuse_distance),
        param_persistence_threshold=int(zero.param_persistence_threshold),
        model_persistence_threshold=int(zero.model_persistence_threshold),
        module_granularity_threshold=int(zero.module_granularity_threshold),
        log_trace_cache_warnings=bool(zero.log_trace_cache_warnings),
        memory_efficient_linear=bool(zero.memory_efficient_linear))


def _leaf_rule(zero: Any, module: torch.nn.Module) -> Any:
    from ds_zero.zero3.leaf import apply_leaf_config, leaf_rule

    leaf = zero.leaf_module  # flagged on the modules as DeepSpeed does, so z3_leaf_module() reports them
    apply_leaf_config(module, leaf.classes, leaf.names, leaf.name_suffixes)
    return leaf_rule(leaf.classes, leaf.names, leaf.name_suffixes)


def _partition_device(config: Any, device: torch.device) -> torch.device:
    par = config.zero_optimization.offload_param
    return torch.device("cpu") if par is not None and str(par.device).endswith(("cpu", "nvme")) else device


def partition_model(module: torch.nn.Module, config: Any, dp_group: Any, device: torch.device,
                    mpu: Any = None, placements: Any = ()) -> Any:
    """Partition every parameter of ``module`` over ``dp_group`` (those built under ``zero.Init`` already are)
    and install the gather/release hooks; returns the ``ParamScheduler``. ``placements``
    (``ds_zero.zero3.expert_groups.PartitionGroup``): the groups AutoEP expert parameters are partitioned over
    instead (their expert-data-parallel groups)."""
    from deepspeed.runtime.engine._module import LOW_DTYPES, broadcast_module
    from ds_zero.swap.from_config import param_swap_settings, swap_params
    from ds_zero.zero3.convert import convert_param
    from ds_zero.zero3.expert_groups import PartitionSpaces, mark_partition_world, placement_name
    from ds_zero.zero3.param import PartitionSpace, is_partitioned
    from ds_zero.zero3.schedule import ParamScheduler
    from ds_zero.zero3.state_dict_hooks import install_state_dict_hooks
    from ds_zero.zeropp.frozen import quantize_nontrainable
    from ds_zero.zeropp.options import ZeroPPOptions, partition_group, zeropp_space

    problems = _unsupported(config, mpu, module)
    if problems:
        raise ConfigError(*problems)
    zero = config.zero_optimization
    zpp = ZeroPPOptions.from_config(zero)  # MiCS: partitions live in the shard group, replicated across them
    space = PartitionSpace.of(partition_group(dp_group, zpp), _partition_device(config, device), device, comm=comm,
                              fetch_all_reduce=bool(zero.use_all_reduce_for_fetch_params),
                              sequential=bool(zero.allgather_sequential))
    space = zeropp_space(space, dp_group, zpp)
    spaces = PartitionSpaces(space, placements)
    whole = [p for p in module.parameters() if not is_partitioned(p)]
    adopted = [p for p in module.parameters() if is_partitioned(p)]
    _check_placed(adopted, spaces)
    _check_same_ranks([p for p in adopted if placement_name(p) is None], space)
    low = LOW_DTYPES.get(config.precision)  # the module cast leaves a zero.Init model's parameters to this step
    for p in adopted:
        _adopt_partitioned(p, spaces.space_for(p), low or p.dtype)
    broadcast_module(module, dp_group, params=[p for p in whole if placement_name(p) is None])
    if placements:  # an expert's value comes from the first rank of its expert-data-parallel group
        from deepspeed.runtime.engine._moe import broadcast_experts

        broadcast_experts([p for p in whole if placement_name(p) is not None])
    for p in whole:
        convert_param(p, spaces.space_for(p), low)
    mark_partition_world(list(module.parameters()))
    swap_params([p for p in module.parameters() if is_partitioned(p)],  # offload_param nvme: ZeRO-Infinity
                param_swap_settings(zero.offload_param, config.aio))
    if zpp.zero_quantized_nontrainable_weights:  # frozen partitions stored int8 (those on NVMe keep their dtype)
        quantize_nontrainable(module.parameters(), zpp.block)
    scheduler = ParamScheduler(module, _schedule_settings(zero), _leaf_rule(zero, module))
    scheduler.partition_parent = dp_group  # build_zero3_stage reduces over the same group (MiCS: its sub-groups)
    scheduler.quantize_frozen_block = zpp.block if zpp.zero_quantized_nontrainable_weights else None
    install_state_dict_hooks(module)
    return scheduler


def _group_ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _check_same_ranks(adopted: list[torch.nn.Parameter], space: Any) -> None:
    """Parameters built under ``zero.Init``/``MiCS_Init`` must be partitioned over the engine's ranks: a group of
    the same size and place but other members (e.g. the data-parallel group where the engine partitions over the
    sequence-data group) would silently pair this rank's partition with another rank's."""
    engine = _group_ranks(space.group)
    for group in {id(p.ds_space.group): p.ds_space.group for p in adopted}.values():
        ranks = _group_ranks(group)
        if ranks != engine:
            raise ConfigError(ConfigProblem(
                "zero_optimization.stage", f"parameters were partitioned by zero.Init over ranks {ranks}, but the "
                f"engine partitions over ranks {engine} (its data-parallel group, the sequence-data-parallel group "
                "with sequence parallelism, or this rank's MiCS shard group); build the model under zero.Init "
                "(deepspeed.zero.MiCS_Init with mics_shard_size) with the same group or mpu as deepspeed.initialize",
                3))


def _check_placed(adopted: list[torch.nn.Parameter], spaces: Any) -> None:
    """A parameter built under ``zero.Init`` that ZeRO-3 must partition over another group (an AutoEP expert over
    its expert-data-parallel group) cannot be re-cut here: it must already be partitioned over that group."""
    for p in adopted:
        wanted = spaces.space_for(p)
        if wanted is not spaces.default and _group_ranks(p.ds_space.group) != _group_ranks(wanted.group):
            raise MoEWithZeroStage3(ConfigProblem(
                "zero_optimization.stage", f"an AutoEP expert parameter (shape {tuple(p.ds_shape)}) is already "
                f"ZeRO-partitioned over a non-expert process group (ranks {_group_ranks(p.ds_space.group)}); its "
                f"expert-data-parallel group is ranks {_group_ranks(wanted.group)}: let AutoEP build the experts "
                "(deepspeed.initialize) rather than partitioning them under zero.Init", 3))


def _adopt_partitioned(param: torch.nn.Parameter, space: Any, dtype: torch.dtype) -> None:
    """A parameter built under ``zero.Init``: its partition follows the engine's dtype and offload device."""
    from ds_zero.zero3.param import retarget_partition

    if param.ds_space.world != space.world or param.ds_space.rank != space.rank:
        raise ConfigError(ConfigProblem("zero_optimization.stage", f"a parameter (shape {tuple(param.ds_shape)}) was "
                                        f"partitioned by zero.Init over {param.ds_space.world} ranks, but the engine's "
                                        f"data-parallel group has {space.world}; build the model under zero.Init with "
                                        "the same data_parallel_group (or mpu) as deepspeed.initialize", 3))
    if param.ds_tensor.dtype != dtype or param.ds_tensor.device != space.device:
        retarget_partition(param, space.device, dtype)  # a partition on NVMe stays there
    if param.data.device != space.compute_device or param.dtype != dtype:
        param.data = torch.empty(0, dtype=dtype, device=space.compute_device)
    param.ds_space = space


def zero3_settings(config: Any) -> Any:
    from ds_zero.stage_1_and_2 import ReduceSettings
    from ds_zero.swap.from_config import optimizer_swap_settings
    from ds_zero.zero3.optimizer import Zero3Settings

    zero = config.zero_optimization
    off = zero.offload_optimizer
    offload = off is not None and str(off.device).endswith(("cpu", "nvme"))  # nvme: steps on the CPU too
    pin = bool(off.pin_memory) if offload else False
    reduce = ReduceSettings(
        bucket_numel=int(zero.reduce_bucket_size), overlap_comm=bool(zero.overlap_comm),
        contiguous_gradients=bool(zero.contiguous_gradients), reduce_scatter=bool(zero.reduce_scatter),
        ignore_unused_parameters=bool(zero.ignore_unused_parameters),
        comm_dtype=comm_dtype(config) or (torch.float32 if config.fp32_allreduce else None),
        prescale_gradients=bool(config.prescale_gradients),
        gradient_predivide_factor=float(config.gradient_predivide_factor))
    check = (config.fp16_enabled or (config.precision == "bf16" and config.bf16.check_grad_overflow)
             or loss_scaler(config) is not None)
    return Zero3Settings(reduce=reduce, clip=float(config.gradient_clipping), check_overflow=bool(check),
                         fp32_grad_accum=grad_accum_fp32(config) and config.precision in ("fp16", "bf16"),
                         offload_optimizer=offload, pin_memory=pin, host_pinning=offload_pinning(pin),
                         load_from_fp32_weights=bool(zero.load_from_fp32_weights),
                         sub_group_size=int(zero.sub_group_size),
                         optimizer_swap=optimizer_swap_settings(off, config.aio))


def build_zero3_stage(inputs: StageInputs) -> tuple[OptimizerWrapper, GradientReducer]:
    """The ZeRO-3 optimizer wrapper over the partitioned model and its reduce-scatter."""
    from deepspeed.__about__ import __version__
    from deepspeed.sequence.groups import sequence_factor, sum_over_sequence_ranks
    from ds_zero.zero3.checkpoint_shards import Zero3CheckpointShards
    from ds_zero.zero3.optimizer import DeepSpeedZeroOptimizer_Stage3
    from ds_zero.zeropp.options import ZeroPPOptions, configure_reducer, partition_group

    config = inputs.config
    if inputs.scheduler is None:
        raise RuntimeError("ZeRO stage 3: the model was not partitioned before the optimizer was built")
    settings = zero3_settings(config)
    names: dict[torch.nn.Parameter, str] = {}
    for name, p in inputs.module.named_parameters():
        names.setdefault(p, name)
    zpp = ZeroPPOptions.from_config(config.zero_optimization)
    factor = sequence_factor(inputs.reduce_group, inputs.dp_group, inputs.dp_world_size)
    # the group the model was partitioned over (sequence parallel: the sequence-data group), so the reduce-scatter
    # (MiCS: its shard and replica sub-groups) pairs every rank with the partition it holds
    group = getattr(inputs.scheduler, "partition_parent", inputs.reduce_group if factor > 1 else inputs.dp_group)
    wrapper = DeepSpeedZeroOptimizer_Stage3(inputs.basic_optimizer, inputs.params, names, inputs.scheduler, settings,
                                            loss_scaler=loss_scaler(config),
                                            dp_group=partition_group(group, zpp), comm=comm)
    configure_reducer(wrapper.reducer, group, zpp, comm)  # MiCS replicas, qgZ
    sum_over_sequence_ranks(wrapper.reducer, factor)
    wrapper.checkpoint_shards = (Zero3CheckpointShards(wrapper, inputs.module, config.to_dict(), __version__,
                                                       bf16=config.precision == "bf16"),)
    return wrapper, wrapper.reducer


_UNSET = object()


def _setting(config: Any, *paths: str, default: Any = None) -> Any:
    """The first of ``paths`` (dotted) that ``config`` has: DeepSpeed's config names, then ds_config's."""
    for path in paths:
        value = config
        for part in path.split("."):
            value = getattr(value, part, _UNSET)
            if value is _UNSET:
                break
        else:
            return value
    return default


class Zero3EngineMethods:
    zero3_scheduler: Any
    module: torch.nn.Module
    _config: Any

    def _validate_zero3_moe_compatibility(self) -> None:
        """DeepSpeed's gate for MoE under ZeRO-3: AutoEP layers only, without AutoTP, sequence parallelism,
        quantized gradients, MiCS or hpZ (``_moe.check_zero3_moe``)."""
        if not getattr(self, "has_moe_layers", False):
            return
        from deepspeed.runtime.engine._moe import check_zero3_moe

        cfg = self._config
        quantized = getattr(self, "zero_quantized_gradients", None)
        expert = _setting(cfg, "expert_parallel_config", "expert_parallel")
        check_zero3_moe(
            self.module, autotp_size=int(_setting(cfg, "tensor_parallel_config.autotp_size",
                                                  "tensor_parallel.autotp_size", default=1) or 1),
            sequence_parallel_size=int(getattr(self, "sequence_parallel_size", 1)),
            quantized_gradients=lambda: bool(quantized()) if callable(quantized) else False,
            mics_shard_size=int(_setting(cfg, "mics_shard_size", "zero_optimization.mics_shard_size", default=0)),
            hpz_partition_size=int(_setting(cfg, "zero_config.zero_hpz_partition_size",
                                            "zero_optimization.zero_hpz_partition_size", default=1)),
            expert_tensor_parallel_size=int(getattr(expert, "expert_tensor_parallel_size", 1) or 1))

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter, persistent ones included (they are gathered again when next used)."""
        if self.zero3_scheduler is not None:
            self.zero3_scheduler.release_all(include_persistent=True)

    def _has_autoep_layers(self) -> bool:
        return any(getattr(m, "_is_autoep_layer", False) for m in self.module.modules())

    def _raise_if_autoep_zero3_consolidated_export(self, api: str) -> None:
        """A consolidated 16-bit state dict gathers each parameter over its partition group: for AutoEP experts that
        is only this rank's experts, so rank 0 would write a model with the other expert-parallel ranks' experts
        missing. Refused, as in DeepSpeed, pointing at the universal conversion."""
        if self.zero_optimization_partition_weights() and self._has_autoep_layers():
            raise NotImplementedError(f"{api}: AutoEP with ZeRO stage 3 has no consolidated 16-bit export (each "
                                      "expert-parallel rank holds other experts); save a checkpoint and convert it "
                                      "with ds_to_universal.py")

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The whole model's weights (training dtype, on the CPU) and persistent buffers, gathered module by
        module so no rank ever holds more than one module's weights at a time beyond the result. Collective;
        rank 0 gets the state dict, the other ranks an empty one (as in DeepSpeed)."""
        from ds_zero.zero3 import GatheredParameters

        self._raise_if_autoep_zero3_consolidated_export("_zero3_consolidated_16bit_state_dict (save_16bit_model)")
        if self.zero3_scheduler is None:
            raise RuntimeError("_zero3_consolidated_16bit_state_dict: this engine does not run ZeRO stage 3 "
                               f"(stage {self.zero_optimization_stage()}); use module.state_dict()")
        keep = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        out: OrderedDict[str, Any] = OrderedDict()
        seen: dict[int, torch.Tensor] = {}
        for prefix, module in self.module.named_modules(remove_duplicate=False):
            prefix = f"{prefix}." if prefix else ""
            params = [p for p in module._parameters.values() if p is not None]
            with GatheredParameters(params):
                if not keep:
                    continue
                for name, p in module._parameters.items():
                    if p is None or (exclude_frozen_parameters and not p.requires_grad):
                        continue
                    if id(p) not in seen:
                        seen[id(p)] = p.detach().cpu().clone()
                    out[prefix + name] = seen[id(p)]
            if keep:
                for name, buf in module._buffers.items():
                    if buf is not None and name not in module._non_persistent_buffers_set:
                        out[prefix + name] = buf.detach().cpu().clone()
        return out
