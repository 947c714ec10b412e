"""Build the basic (unwrapped) optimizer: the client's, or the one the ``optimizer`` config section names.

DeepSpeed's names (case-insensitive): Adam/AdamW -> ds_ops ``FusedAdam`` (torch's Adam/AdamW with
``torch_adam``; ``adam_w_mode`` selects decoupled weight decay, always on for AdamW), Lamb -> ``FusedLamb``,
Lion -> ``FusedLion``, Adagrad -> ``torch.optim.Adagrad``; with ZeRO optimizer offload to the CPU the
DeepSpeedCPU* variants; OneBitAdam / ZeroOneAdam / OneBitLamb -> ``deepspeed.runtime.fp16.onebit`` (ZeRO stage 0
only); Muon -> ``MuonWithAuxAdam`` over the parameters' ``use_muon`` flags (``deepspeed.runtime.muon_groups``);
MuAdam/MuAdamW/MuSGD -> the optional ``mup`` package's. Any other name is looked up in ``torch.optim``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed.runtime.optimizer_wrapper import OptimizerWrapper
from ds_config import ConfigError, ConfigProblem

# what ZeRO accepts without ``zero_allow_untested_optimizer`` (class names, as DeepSpeed's list)
ZERO_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "FusedLamb", "DeepSpeedCPUAdagrad",
                             "Adagrad", "FusedLion", "DeepSpeedCPULion", "Lion", "MuonWithAuxAdam")


def _torch_optimizers() -> dict[str, type]:
    return {name: cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}


def _adam(params: Any, kwargs: dict[str, Any], name: str, cpu_offload: bool) -> torch.optim.Optimizer:
    from ds_ops import DeepSpeedCPUAdam, FusedAdam

    torch_adam = bool(kwargs.pop("torch_adam", False))
    adam_w_mode = bool(kwargs.pop("adam_w_mode", kwargs.pop("adamw_mode", True)))
    adam_w_mode = name == "adamw" or adam_w_mode
    if torch_adam:
        kwargs.pop("set_grad_none", None)
        kwargs.pop("fp32_optimizer_states", None)
        params = list(params)
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **_fastest_torch_kernel(params, kwargs))
    if cpu_offload:
        kwargs.pop("set_grad_none", None)
        return DeepSpeedCPUAdam(params, adamw_mode=adam_w_mode, **kwargs)
    kwargs.pop("fp32_optimizer_states", None)
    return FusedAdam(params, adam_w_mode=adam_w_mode, **kwargs)


def _param_tensors(params: list) -> list[torch.Tensor]:
    return [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]


def _fastest_torch_kernel(params: list, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch_adam``: torch's fused kernel where every parameter is a floating tensor on a device it supports
    (CPU included: 8 ms against 40-70 ms for the default per-tensor loop on a 6.3M-parameter MLP), unless the
    config chose ``fused``/``foreach`` itself or asks for options the fused kernel lacks; same update math."""
    if any(k in kwargs for k in ("fused", "foreach")) or kwargs.get("capturable") or kwargs.get("differentiable"):
        return kwargs
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    tensors = [p for p in _param_tensors(params) if isinstance(p, torch.Tensor)]
    if tensors and all(p.is_floating_point() and p.device.type in supported and not p.is_sparse for p in tensors):
        return {**kwargs, "fused": True}
    return kwargs


def _deepspeed_optimizer(name: str, params: Any, kwargs: dict[str, Any], cpu_offload: bool) -> torch.optim.Optimizer:
    import ds_ops

    if name in ("adam", "adamw"):
        return _adam(params, kwargs, name, cpu_offload)
    if name == "lamb":
        return ds_ops.FusedLamb(params, **kwargs)
    if name == "lion":
        return (ds_ops.DeepSpeedCPULion if cpu_offload else ds_ops.FusedLion)(params, **kwargs)
    if name == "adagrad":
        return (ds_ops.DeepSpeedCPUAdagrad if cpu_offload else torch.optim.Adagrad)(params, **kwargs)
    if name == "onebitadam":  # the 1-bit optimizers communicate themselves: build_stage0 gives it no gradient reducer
        from deepspeed.runtime.fp16.onebit.adam import OnebitAdam

        return OnebitAdam(params, **kwargs)
    if name == "zerooneadam":
        from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

        return ZeroOneAdam(params, **kwargs)
    if name == "onebitlamb":
        from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb

        return OnebitLamb(params, **kwargs)
    if name == "muon":
        from deepspeed.runtime.muon_groups import muon_optimizer

        return muon_optimizer(params, kwargs)
    if name in MUP_OPTIMIZERS:
        return _mup(name, params, kwargs)
    raise ConfigError(ConfigProblem("optimizer.type", "is not a DeepSpeed optimizer; accepted: Adam, AdamW, "
                                    "OneBitAdam, ZeroOneAdam, Lamb, OneBitLamb, Lion, Adagrad, Muon, MuAdam, "
                                    "MuAdamW, MuSGD or a torch.optim class name", name))


MUP_OPTIMIZERS = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}


def _mup(name: str, params: Any, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """The ``mup`` package's muP optimizers (Adam/AdamW/SGD with per-parameter learning rates scaled by each
    weight's infinite-width shape, which ``mup.set_base_shapes`` attached to the model). ``mup`` is optional:
    imported here, only when the config names one of them."""
    cls_name = MUP_OPTIMIZERS[name]
    try:
        import mup
    except ImportError as exc:
        raise ConfigError(ConfigProblem("optimizer.type", f"{cls_name} comes from the 'mup' package, which is not "
                                        "installed; install it (pip install mup) or choose another optimizer",
                                        cls_name)) from exc
    return getattr(mup, cls_name)(params, **kwargs)


def mark_muon_params(module: torch.nn.Module, client: Any, section: Any) -> None:
    """The config's Muon (no client optimizer): DeepSpeed's default ``use_muon`` flag on unflagged parameters."""
    if client is None:
        from deepspeed.runtime.muon_groups import mark_muon_params as mark

        mark(module, section)


def optimizer_from_config(section: Any, params: Iterable, cpu_offload: bool = False) -> torch.optim.Optimizer:
    """The optimizer a typed ``optimizer`` section (``DeepSpeedConfig.optimizer``) describes, over ``params``."""
    kwargs = section.constructor_params()
    auto = [ConfigProblem(f"optimizer.params.{k}", 'is still "auto"; fill it in before deepspeed.initialize', v)
            for k, v in kwargs.items() if isinstance(v, str) and v == "auto"]
    if auto:
        raise ConfigError(auto)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    name = section.name
    if section.is_deepspeed_optimizer:
        def builder(p: Any, **kw: Any) -> torch.optim.Optimizer:
            return _deepspeed_optimizer(name, p, kw, cpu_offload)
    else:
        classes = _torch_optimizers()
        if name not in classes:
            raise ConfigError(ConfigProblem("optimizer.type", "unknown optimizer; accepted: Adam, AdamW, Lamb, Lion, "
                                            f"Adagrad, or a torch.optim class ({', '.join(sorted(classes))})", name))
        builder = classes[name]
    try:
        return builder(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(ConfigProblem("optimizer.params", f"{section.type}: {exc}")) from exc


def build_basic_optimizer(client: Any, section: Any, params: list, cpu_offload: bool = False) -> torch.optim.Optimizer:
    """The client optimizer (an instance, or a callable taking the parameters), else the config's.

    As in DeepSpeed, a client optimizer wins over the config's ``optimizer`` section (with a warning), so scripts
    that pass both keep running.
    """
    if client is not None and section is not None:
        from deepspeed.utils import logger

        logger.warning("deepspeed.initialize: an optimizer was passed, so the config's 'optimizer' section "
                       f"({section.type}) is ignored")
    if client is None:
        if section is None:
            raise ValueError("deepspeed.initialize: no optimizer: pass optimizer=... or add an 'optimizer' section "
                             "to the config")
        return optimizer_from_config(section, params, cpu_offload)
    if isinstance(client, torch.optim.Optimizer):
        return client
    if callable(client):
        built = client(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"deepspeed.initialize: the optimizer callable returned {type(built).__name__}, expected "
                            "a torch.optim.Optimizer")
        return built
    raise TypeError(f"deepspeed.initialize: optimizer={type(client).__name__} is not a torch.optim.Optimizer or a "
                    "callable taking the model parameters")


def check_zero_optimizer(optimizer: torch.optim.Optimizer, zero_stage: int, allow_untested: bool) -> None:
    """ZeRO's rule: an optimizer outside the tested list needs ``zero_allow_untested_optimizer: true``.
    1-bit optimizers average their own (compressed) momentum: ZeRO stage 0 only, as in DeepSpeed."""
    if zero_stage > 0 and getattr(optimizer, "communicates_gradients", False):
        raise ConfigError(ConfigProblem("zero_optimization.stage", f"{type(optimizer).__name__} (1-bit "
                                        "compressed communication) is not compatible with ZeRO; set "
                                        "zero_optimization.stage to 0", zero_stage))
    if zero_stage == 0 or allow_untested:
        return
    name = type(optimizer).__name__
    if name not in ZERO_SUPPORTED_OPTIMIZERS:
        raise ConfigError(ConfigProblem("zero_allow_untested_optimizer", f"ZeRO stage {zero_stage} has not been "
                                        f"tested with optimizer {name}; set \"zero_allow_untested_optimizer\": true "
                                        f"to use it anyway (tested: {', '.join(ZERO_SUPPORTED_OPTIMIZERS)})", False))


def build_scheduler(client: Any, config: Any, wrapper: OptimizerWrapper) -> Any:
    """The client's schedule (an instance, or a callable taking the optimizer), else the config's, else None.

    As in DeepSpeed, a client schedule wins over the config's ``scheduler`` section (with a warning).
    """
    from deepspeed.runtime.lr_schedules import build_lr_scheduler
    from deepspeed.utils import logger

    if client is not None:
        if config.scheduler is not None:
            logger.warning("deepspeed.initialize: an lr_scheduler was passed, so the config's 'scheduler' section "
                           f"({config.scheduler.type}) is ignored")
        if hasattr(client, "step") and hasattr(client, "state_dict"):
            return client
        if callable(client):
            return client(wrapper.optimizer)
        raise TypeError(f"deepspeed.initialize: lr_scheduler={type(client).__name__} is neither a schedule (with "
                        "step/state_dict) nor a callable taking the optimizer")
    return build_lr_scheduler(config.scheduler, wrapper)
