"""DeepSpeedCPUAdagrad: Adagrad on CPU tensors with the native SIMD + OpenMP kernel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ds_ops import reference
from ds_ops.cpu_optimizer import CPUOptimizer, Item
from ds_ops.op_builder import CPUAdagradBuilder

# torch.optim.Adagrad's param-group keys beyond lr/eps/weight_decay, with the values DeepSpeed's Adagrad implements
TORCH_ADAGRAD_GROUP_KEYS: dict[str, Any] = {"lr_decay": 0, "initial_accumulator_value": 0, "foreach": None,
                                            "maximize": False, "differentiable": False, "fused": None}
_UNSUPPORTED = ("lr_decay", "initial_accumulator_value", "maximize")


class DeepSpeedCPUAdagrad(CPUOptimizer):
    """Adagrad (L2 weight decay, no lr decay) for params held in CPU memory.

    The accumulator is stored as ``sum`` (``torch.optim.Adagrad``'s name, so state_dicts interoperate);
    DeepSpeed's ``exp_avg_sq`` is accepted on load. Dtypes, the fused copy and the fallback work as in
    :class:`~ds_ops.adam.DeepSpeedCPUAdam`.
    """

    STATE_NAMES = ("sum",)
    STATE_ALIASES = {"exp_avg_sq": "sum"}
    BUILDER = CPUAdagradBuilder
    SYMBOL = "ds_cpu_adagrad_step"

    def __init__(self, model_params: Iterable, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True, *,
                 allow_torch_fallback: bool | None = None) -> None:
        # torch.optim.Adagrad's group keys too (its step reads them), at the values this kernel implements, so a
        # state_dict saved here loads into torch's Adagrad and continues the same run
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **TORCH_ADAGRAD_GROUP_KEYS)
        super().__init__(model_params, defaults, fp32_optimizer_states, allow_torch_fallback)

    def _hyper(self, group: dict[str, Any]) -> list[float]:
        # groups loaded from torch's Adagrad carry its options: only the values this kernel computes are accepted
        for key in _UNSUPPORTED:
            if group.get(key, TORCH_ADAGRAD_GROUP_KEYS[key]) != TORCH_ADAGRAD_GROUP_KEYS[key]:
                raise ValueError(f"DeepSpeedCPUAdagrad: {key}={group[key]!r} is not supported; expected "
                                 f"{TORCH_ADAGRAD_GROUP_KEYS[key]!r}")
        return [group["lr"], group["eps"], group["weight_decay"]]

    def _torch_update(self, group: dict[str, Any], items: list[Item]) -> None:
        self._hyper(group)
        reference.adagrad_update([it[0] for it in items], [it[1] for it in items], [it[2][0] for it in items],
                                  lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])
