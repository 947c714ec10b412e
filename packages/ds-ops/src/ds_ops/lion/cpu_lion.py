"""DeepSpeedCPULion: Lion on CPU tensors with the native SIMD + OpenMP kernel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ds_ops import reference
from ds_ops.cpu_optimizer import CPUOptimizer, Item
from ds_ops.op_builder import CPULionBuilder


class DeepSpeedCPULion(CPUOptimizer):
    """Lion (Chen et al. 2023, decoupled weight decay) for params held in CPU memory.

    State: ``step`` and ``exp_avg``. Dtypes, the fused copy and the fallback work as in
    :class:`~ds_ops.adam.DeepSpeedCPUAdam`.
    """

    STATE_NAMES = ("exp_avg",)
    BUILDER = CPULionBuilder
    SYMBOL = "ds_cpu_lion_step"

    def __init__(self, model_params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True, *,
                 allow_torch_fallback: bool | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states, allow_torch_fallback)

    def _hyper(self, group: dict[str, Any]) -> list[float]:
        beta1, beta2 = group["betas"]
        return [group["lr"], beta1, beta2, group["weight_decay"]]

    def _torch_update(self, group: dict[str, Any], items: list[Item]) -> None:
        beta1, beta2 = group["betas"]
        reference.lion_update([it[0] for it in items], [it[1] for it in items], [it[2][0] for it in items],
                               lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])
