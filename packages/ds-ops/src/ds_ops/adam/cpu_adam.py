"""DeepSpeedCPUAdam: Adam/AdamW on CPU tensors with the native SIMD + OpenMP kernel."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ds_ops import reference
from ds_ops.cpu_optimizer import CPUOptimizer, Item
from ds_ops.op_builder import CPUAdamBuilder


class DeepSpeedCPUAdam(CPUOptimizer):
    """Adam (``adamw_mode=False``, L2 decay) or AdamW (decoupled decay) for params held in CPU memory.

    Params may be float32, bfloat16 or float16; states are float32 unless ``fp32_optimizer_states=False``
    (then they take the param dtype). State layout (``step``, ``exp_avg``, ``exp_avg_sq``) matches
    ``torch.optim.Adam``/``AdamW``, so state_dicts load in either direction. ``step(fp16_param_groups=...)``
    also writes the updated params into low-precision buffers in the same pass (ZeRO-Offload).
    ``allow_torch_fallback`` (or ``DS_OPS_ALLOW_TORCH_FALLBACK=1``) permits a slower pure-torch update,
    with a warning, when the native op cannot be built; otherwise construction raises ``OpBuildError``.
    """

    STATE_NAMES = ("exp_avg", "exp_avg_sq")
    BUILDER = CPUAdamBuilder
    SYMBOL = "ds_cpu_adam_step"

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True, *,
                 allow_torch_fallback: bool | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad)
        self.adam_w_mode = bool(adamw_mode)
        super().__init__(model_params, defaults, fp32_optimizer_states, allow_torch_fallback)

    def _hyper(self, group: dict[str, Any]) -> list[float]:
        beta1, beta2 = group["betas"]
        return [group["lr"], beta1, beta2, group["eps"], group["weight_decay"], float(self.adam_w_mode)]

    def _per_tensor(self, group: dict[str, Any], step: int) -> tuple[float, float]:
        """(step size, 1/sqrt(bias correction 2)) for a tensor at 1-based ``step``."""
        if not group["bias_correction"]:
            return (group["lr"], 1.0)
        beta1, beta2 = group["betas"]
        return (group["lr"] / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step))

    def _torch_update(self, group: dict[str, Any], items: list[Item]) -> None:
        beta1, beta2 = group["betas"]
        reference.adam_update(
            [it[0] for it in items], [it[1] for it in items], [it[2][0] for it in items],
            [it[2][1] for it in items], [it[4] for it in items], lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
            adamw_mode=self.adam_w_mode)

    # ---- DeepSpeed's sub-group interface (SuperOffload: one flat sub-group partition in the optimizer at a time) --
    def _subgroup_items(self, call: str) -> list[tuple[dict[str, Any], torch.Tensor]]:
        items = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for _, p in items:
            if p.device.type != "cpu":
                raise ValueError(f"{call}: DeepSpeedCPUAdam steps CPU tensors; a parameter is on {p.device} (enable "
                                 "offload_optimizer: {device: cpu} in the ZeRO config)")
        return items

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Any = None) -> Any:
        """One Adam step of the parameters that have gradients, with the moments and step count kept under
        ``self.state[subgroup_id]`` instead of per parameter (the caller swaps sub-group partitions in and out
        of the optimizer, as DeepSpeed's SuperOffload does)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, p in self._subgroup_items("step_subgroup"):
            state = self.state[subgroup_id]
            if not state:
                dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                state.update(step=0, exp_avg=torch.zeros_like(p, dtype=dtype),
                             exp_avg_sq=torch.zeros_like(p, dtype=dtype))
            state["step"] += 1
            self._subgroup_math(reference.adam_update, group, p, state)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Any = None) -> Any:
        """Undo the last :meth:`step_subgroup` of ``sub_group_id`` (same gradients): parameters and moments go
        back, the step count drops by one. Raises ``RuntimeError`` for a sub-group never stepped or at step 0."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state.get(sub_group_id) if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not been "
                               "initialized (step_subgroup was never called for it)")
        if state.get("step", 0) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        for group, p in self._subgroup_items("rollback_subgroup"):
            self._subgroup_math(reference.adam_rollback, group, p, state)
            state["step"] -= 1
        return loss

    def _subgroup_math(self, fn: Any, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        if state["exp_avg"].shape != p.shape:
            raise ValueError(f"sub-group state has shape {tuple(state['exp_avg'].shape)}, the parameter "
                             f"{tuple(p.shape)}: one sub-group holds one flat partition")
        beta1, beta2 = group["betas"]
        fn([p.data], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [state["step"]], lr=group["lr"],
           beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
           bias_correction=group["bias_correction"], adamw_mode=self.adam_w_mode)
