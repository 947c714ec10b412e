"""DeepSpeedCPUAdagrad: Adagrad on CPU tensors with the native SIMD + OpenMP kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

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
    :class:`~ds_ops.adam.DeepSpeedCPUAdam`. Sparse (COO) gradients, such as ``nn.Embedding(sparse=True)``'s,
    update only the entries they hold, param and accumulator alike, as ``torch.optim.Adagrad`` does.
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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             fp16_param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = []  # sparse grads are applied here; the dense pass must not see them
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    self._sparse_update(group, gi, pi, p)
                    if fp16_param_groups is not None:
                        target = fp16_param_groups[gi][pi]
                        target.copy_(p.view(target.shape))
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            super().step(None, fp16_param_groups)
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss

    def _sparse_update(self, group: dict[str, Any], gi: int, pi: int, p: torch.Tensor) -> None:
        self._hyper(group)
        grad = p.grad
        if not (p.is_cpu and p.is_floating_point() and grad.is_cpu and grad.shape == p.shape):
            raise ValueError(f"{type(self).__name__}: sparse grad of param {pi} of group {gi} is {grad.dtype} "
                             f"{tuple(grad.shape)} on {grad.device} for a {p.dtype} {tuple(p.shape)} param on "
                             f"{p.device}; expected a CPU grad of the param's shape")
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        state["step"] += 1
        grad = grad.coalesce()
        where = tuple(grad.indices())  # one index tensor per sparse dim; dense dims stay whole (hybrid COO)
        values = p.data[where]
        sums = state["sum"][where]
        reference.adagrad_update([values], [grad.values()], [sums], lr=group["lr"], eps=group["eps"],
                                 weight_decay=group["weight_decay"])
        p.data[where] = values
        state["sum"][where] = sums
