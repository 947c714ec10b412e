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

    masters_key: str | None = None
    """Where DeepSpeed's class keeps the fp32 masters in its state dict (``fp32_groups``: per group, per
    parameter; ``fp32_groups_flat``: one flat tensor per group); None: this project's own layout."""

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's layout when the class has one (so real DeepSpeed loads it, and we load DeepSpeed's): the
        loss-scale state, the wrapped optimizer's state dict, the fp32 masters under ``masters_key``; plus this
        project's ``fp32_master_weights`` (model order, read by the pipeline's and the universal checkpoint's
        re-sharding), which share the masters' storage, so nothing is written twice."""
        state = super().state_dict()
        if self.masters_key is None:
            return state
        scaler = self.loss_scaler
        dynamic = bool(getattr(scaler, "dynamic", False))
        state.update(dynamic_loss_scale=dynamic, cur_scale=float(scaler.cur_scale) if scaler is not None else 1.0,
                     cur_iter=int(getattr(scaler, "cur_iter", 0)))
        if dynamic:
            state.update(last_overflow_iter=scaler.last_overflow_iter, scale_factor=scaler.scale_factor,
                         scale_window=scaler.scale_window)
        if self.masters_key == "fp32_groups_flat":
            flats = self.fp32_groups_flat
            views = {id(m): piece.view(m.shape)
                     for flat, group in zip(flats, self.fp32_groups, strict=True)
                     for piece, m in zip(torch.split(flat, [m.numel() for m in group]) if group else [], group,
                                         strict=True)}
            state["fp32_groups_flat"] = flats
            state["fp32_master_weights"] = [views[id(self.master_of[p])] for p in self.model_params]
        else:
            state["fp32_groups"] = self.fp32_groups
        return state

    def _saved_masters(self, state_dict: dict[str, Any]) -> list[torch.Tensor] | None:
        """The saved fp32 masters in ``model_params`` order, from either layout, or None."""
        if "fp32_master_weights" in state_dict:
            return list(state_dict["fp32_master_weights"])
        groups = [list(g["params"]) for g in self.optimizer.param_groups]
        if "fp32_groups" in state_dict:
            saved = [list(g) for g in state_dict["fp32_groups"]]
        elif "fp32_groups_flat" in state_dict:
            saved = [list(torch.split(flat.reshape(-1), [m.numel() for m in group])) if group else []
                     for flat, group in zip(state_dict["fp32_groups_flat"], groups, strict=True)]
        else:
            return None
        shapes = [[tuple(m.shape) for m in g] for g in groups]
        pairs = [(t, m) for sg, g in zip(saved, groups, strict=False) for t, m in zip(sg, g, strict=False)]
        if [len(g) for g in saved] != [len(g) for g in groups] or any(t.numel() != m.numel() for t, m in pairs):
            raise ValueError(f"optimizer state: the saved fp32 master weights ({[len(g) for g in saved]} per group) "
                             f"do not fit this model's trainable parameters ({shapes})")
        by_master = {id(m): t for t, m in pairs}
        return [by_master[id(self.master_of[p])].reshape(self.master_of[p].shape) for p in self.model_params]

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        """Either layout: DeepSpeed's (``cur_scale``, ``fp32_groups`` / ``fp32_groups_flat``) or this project's
        earlier one (``fp32_master_weights``, ``loss_scaler``). Without ``load_optimizer_states`` only the fp32
        masters are taken (this optimizer's moments stay)."""
        masters = self._saved_masters(state_dict)
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
            scaler = self.loss_scaler
            if scaler is not None and "loss_scaler" in state_dict:
                scaler.load_state_dict(state_dict["loss_scaler"])
            elif scaler is not None and "cur_scale" in state_dict:  # written by DeepSpeed
                scaler.cur_scale = float(state_dict["cur_scale"])
                for key in ("cur_iter", "last_overflow_iter"):
                    if key in state_dict and hasattr(scaler, key):
                        setattr(scaler, key, int(state_dict[key]))
        if masters is None:
            self.sync_master_from_model()
            return
        with torch.no_grad():
            for p, weights in zip(self.model_params, masters, strict=True):
                self.master_of[p].data.copy_(weights)
                if load_optimizer_states:
                    p.data.copy_(weights)

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
