"""What DeepSpeed's stage-0 mixed-precision optimizer classes share: the engine's ``MixedPrecisionOptimizer``
(fp32 masters, loss scaling, clipping, overflow agreement) under DeepSpeed's constructors, attributes and methods.

``FP16_Optimizer`` (fused), ``FP16_UnfusedOptimizer`` and ``BF16_Optimizer`` are the classes the engine builds at
ZeRO stage 0, so ``isinstance(engine.optimizer, FP16_UnfusedOptimizer)`` holds as in DeepSpeed; built directly
from their DeepSpeed arguments they work standalone (``backward(loss)`` then ``step()``).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.runtime.fp16.loss_scaler import (
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
    LossScaleConfig,
    LossScaleProfile,
)
from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler, StaticLossScaler
from deepspeed.runtime.precision.optimizers import MixedPrecisionOptimizer, Scaler
from ds_zero.grad_norm import norm_scope

_LOW_DTYPES = (torch.float16, torch.bfloat16)


def scaler_from_config(config: LossScaleConfig, dynamic_loss_args: dict[str, Any] | None) -> Scaler:
    """The engine's scaler for a DeepSpeed ``LossScaleConfig`` (None without grad scaling: bf16)."""
    if not config.use_grad_scaling:
        return None
    if not config.dynamic_loss_scale:
        return StaticLossScaler(config.cur_scale)
    args = dynamic_loss_args or {}
    return DynamicLossScaler(init_scale=config.cur_scale, scale_factor=config.scale_factor,
                             scale_window=config.scale_window, min_scale=config.min_loss_scale,
                             delayed_shift=int(args.get(DELAYED_SHIFT, 1)),
                             consecutive_hysteresis=bool(args.get(CONSECUTIVE_HYSTERESIS, False)))


def config_of(scaler: Scaler, dtype: torch.dtype, profile: LossScaleProfile) -> LossScaleConfig:
    """The ``LossScaleConfig`` describing the engine's ``scaler`` (what DeepSpeed's engine passes its optimizer)."""
    if scaler is None or not scaler.dynamic:
        return LossScaleConfig(dtype, False, scaler.cur_scale if scaler is not None else 1.0, None, profile=profile)
    args = {INITIAL_LOSS_SCALE: scaler.cur_scale, SCALE_WINDOW: scaler.scale_window, MIN_LOSS_SCALE: scaler.min_scale,
            DELAYED_SHIFT: scaler.delayed_shift, CONSECUTIVE_HYSTERESIS: scaler.consecutive_hysteresis}
    config = LossScaleConfig(dtype, True, 1.0, args, profile=profile)
    config.scale_factor = scaler.scale_factor
    return config


def _dp_group(mpu: Any) -> Any:
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return mpu.get_data_parallel_group()
    return None


class LegacyMixedPrecision(MixedPrecisionOptimizer, DeepSpeedOptimizer):
    """Base of the DeepSpeed-named classes; ``profile`` picks the dynamic-scale defaults (fused or unfused)."""

    profile = LossScaleProfile.FUSED
    fp32_grad_accum_default = False

    def __init__(self, init_optimizer: torch.optim.Optimizer, *, loss_scale_config: LossScaleConfig | None,
                 low_precision_dtype: torch.dtype, static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False,
                 initial_dynamic_scale: float | None = None, dynamic_loss_args: dict[str, Any] | None = None,
                 mpu: Any = None, clip_grad: float = 0.0, dp_group: Any = None) -> None:
        if low_precision_dtype not in _LOW_DTYPES:
            raise ValueError(f"{type(self).__name__}: low_precision_dtype={low_precision_dtype!r}; accepted: "
                             "torch.float16, torch.bfloat16")
        if loss_scale_config is None:
            loss_scale_config = LossScaleConfig(low_precision_dtype, dynamic_loss_scale, static_loss_scale,
                                                dynamic_loss_args, profile=self.profile,
                                                initial_dynamic_scale=initial_dynamic_scale)
        scaler = scaler_from_config(loss_scale_config, dynamic_loss_args)
        super().__init__(init_optimizer, clip=clip_grad, loss_scaler=scaler,
                         dp_group=dp_group if dp_group is not None else _dp_group(mpu),
                         check_overflow=low_precision_dtype == torch.float16,
                         fp32_grad_accum=self.fp32_grad_accum_default, norm_scope=norm_scope(mpu))
        self._set_names(low_precision_dtype, loss_scale_config, mpu)

    @classmethod
    def from_engine(cls, optimizer: torch.optim.Optimizer, *, low_precision_dtype: torch.dtype,
                    **wrapper_args: Any) -> LegacyMixedPrecision:
        """The engine's stage-0 wrapper (``MixedPrecisionOptimizer``'s arguments, its scaler already built)."""
        self = cls.__new__(cls)
        MixedPrecisionOptimizer.__init__(self, optimizer, **wrapper_args)
        self._set_names(low_precision_dtype, config_of(self.loss_scaler, low_precision_dtype, cls.profile), None)
        return self

    def _set_names(self, dtype: torch.dtype, config: LossScaleConfig, mpu: Any) -> None:
        self.low_precision_dtype = dtype
        self.loss_scale_config = config
        self.mpu = mpu
        self.clip_grad = self.clip
        self.dynamic_loss_scale = bool(getattr(self.loss_scaler, "dynamic", False))

    # ---- DeepSpeed's methods ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, create_graph: bool = False, retain_graph: bool = False) -> None:
        """Backward of the scaled loss (gradients land in the low-precision parameters' ``.grad``)."""
        self.scale_loss(loss.float()).backward(create_graph=create_graph, retain_graph=retain_graph)

    def step(self, closure: Any = None) -> bool:
        """One update (skipped on overflow); ``closure`` is refused as in DeepSpeed's optimizers."""
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step(closure=...): closures are not supported")
        return super().step()

    def _hp_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        if self.fp32_grad_accum:  # standalone use: gradients from backward() not yet folded into the fp32 buffers
            for p in self.model_params:
                self.on_grad(p)
        return super()._hp_grads()

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            super().load_state_dict(state_dict)
            return
        saved = state_dict.get("fp32_master_weights")  # weights only: keep this optimizer's moments
        if saved is not None:
            with torch.no_grad():
                for p, weights in zip(self.model_params, saved, strict=True):
                    self.master_of[p].data.copy_(weights)
        else:
            self.sync_master_from_model()

    def refresh_fp32_params(self) -> None:
        """Copy the (possibly edited) low-precision weights into the fp32 masters."""
        self.sync_master_from_model()

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def override_loss_scale(self, loss_scale: float) -> None:
        """Pin the loss scale to ``loss_scale`` from now on (a static scale)."""
        self.loss_scaler = StaticLossScaler(loss_scale)
        self.dynamic_loss_scale = False

    @property
    def fp32_groups(self) -> list[list[torch.nn.Parameter]]:
        """The fp32 master weights per parameter group (the torch optimizer's own parameters)."""
        return [list(group["params"]) for group in self.optimizer.param_groups]

    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model's low-precision parameters per group (DeepSpeed's name, bf16 ones too)."""
        masters = {id(m): p for p, m in self.master_of.items()}
        return [[masters[id(m)] for m in group["params"]] for group in self.optimizer.param_groups]
