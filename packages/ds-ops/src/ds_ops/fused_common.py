"""Plumbing shared by the multi-tensor optimizers (FusedAdam, FusedLamb, FusedLion): closure handling, grad
clearing, and gathering each group's params with grads together with their lazily created state."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ds_ops.validate import check_group


class Batch(NamedTuple):
    """One group's params that have a grad, in order, with their grads, named state tensors and step counters."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: dict[str, list[torch.Tensor]]
    steps: list[Any]


class FusedOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base of the fused optimizers; subclasses set the class attributes and implement ``_step_groups``.

    ``NAME`` prefixes error messages; ``STATES`` are the per-param tensors created as zeros like the param;
    ``TENSOR_STEP`` keeps ``step`` as a float32 tensor that torch's fused kernels advance themselves (else
    it is an int advanced here, once per step that the param has a grad); ``SPARSE_HINT`` ends the sparse
    gradient error.
    """

    NAME = "FusedOptimizer"
    STATES: tuple[str, ...] = ()
    TENSOR_STEP = False
    SPARSE_HINT = ""
    set_grad_none = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drop grads (``set_grad_none=True``, the default) or zero them in place."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, then each ``step`` in this optimizer's form: a float32 tensor on the param's device
        (``TENSOR_STEP``, what torch's fused kernels take) or an int, whatever form the saving optimizer used
        (DeepSpeed's CPU optimizers count in ints; a resume may switch ``offload_optimizer`` on or off). Group keys
        the saved groups lack keep their current values."""
        before = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, old in zip(self.param_groups, before, strict=True):
            for key, value in old.items():  # keys another optimizer does not save (torch's Adam: bias_correction)
                group.setdefault(key, value)
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "step" not in state:
                    continue
                step = state["step"]
                if self.TENSOR_STEP:
                    state["step"] = (step.detach().to(device=p.device, dtype=torch.float32).reshape(())
                                     if torch.is_tensor(step)
                                     else torch.tensor(float(step), dtype=torch.float32, device=p.device))
                elif torch.is_tensor(step):
                    state["step"] = int(step.item())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group; returns the closure's loss (evaluated with grad enabled) or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_groups()
        return loss

    @abc.abstractmethod
    def _step_groups(self) -> None:
        """Update every param group (called under ``torch.no_grad``)."""

    def _gather(self, group: dict[str, Any]) -> Batch:
        """Validate ``group`` and collect its params that have a grad, creating their state on first use."""
        check_group(self.NAME, group)
        batch = Batch([], [], {name: [] for name in self.STATES}, [])
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"{self.NAME} does not support sparse gradients{self.SPARSE_HINT}")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if self.TENSOR_STEP else 0
                for name in self.STATES:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not self.TENSOR_STEP:
                state["step"] += 1
            batch.params.append(p)
            batch.grads.append(p.grad)
            for name in self.STATES:
                batch.states[name].append(state[name])
            batch.steps.append(state["step"])
        return batch
