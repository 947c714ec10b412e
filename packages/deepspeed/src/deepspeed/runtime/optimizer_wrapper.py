"""The two seams between the engine and its optimizer: what an optimizer wrapper and a gradient reducer do.

The engine drives any precision/ZeRO variant through these interfaces only: stage 0 (``_precision`` and
``grad_reduce``) implements them here; ZeRO stages 1-3 implement them with partitioned state and
reduce-scatter. One training micro-step is::

    loss' = wrapper.scale_loss(loss)            # loss scaling (fp16); the engine also divides by GAS
    loss'.backward()                            # per parameter, as its gradient lands:
        wrapper.on_grad(p)                      #   precision bookkeeping (e.g. fp32 accumulation)
        reducer.grad_ready(p)                   #   only on a syncing boundary micro-step (overlapped comm)
    reducer.finish()                            # end of that backward: gradients are averaged over ranks
    wrapper.step() -> stepped                   # at the boundary: unscale, overflow check, clip, update
    wrapper.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class OptimizerWrapper(Protocol):
    """The optimizer as the engine sees it: precision, loss scaling, clipping and the update itself.

    ``optimizer`` is the wrapped ``torch.optim.Optimizer`` (its ``param_groups`` are what LR schedules
    drive). ``loss_scale`` is 1.0 without loss scaling. ``global_grad_norm`` is the unscaled global L2 norm
    of the last step's gradients (``None`` when it was not computed). ``overflow`` tells whether the last
    ``step()`` was skipped.
    """

    optimizer: torch.optim.Optimizer
    global_grad_norm: float | None
    overflow: bool

    @property
    def loss_scale(self) -> float: ...

    @property
    def scales_loss(self) -> bool:
        """True when gradients must come from a scaled loss (fp16): a plain ``loss.backward()`` is an error."""
        ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """Called as each model parameter's gradient lands, on every micro-step."""
        ...

    def get_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The tensor holding ``param``'s accumulated gradient (what the reducer averages), or None."""
        ...

    def set_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Install ``grad`` as ``param``'s accumulated gradient (used when this rank produced none)."""
        ...

    def grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """dtype of ``get_grad(param)`` (the reducer picks its communication dtype from it)."""
        ...

    def step(self) -> bool:
        """Apply the accumulated (already averaged) gradients; False when the step was skipped (overflow)."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def sync_master_from_model(self) -> None:
        """Refresh high-precision master weights from the model's (after loading module weights only)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class GradientReducer(Protocol):
    """Averages gradients over the data-parallel group during a syncing backward.

    ``grad_ready(p)`` is called as each parameter's accumulated gradient is final for this backward (a
    reducer may start communication right away, overlapping the rest of backward); ``finish()`` at the end
    of that backward returns when every gradient (``wrapper.get_grad``) holds the data-parallel average.

    ``every_micro_step``: False (stage 0/1) means the engine syncs only on the accumulation-boundary backward
    and only with more than one rank; True (partitioned gradients, ZeRO-2/3) means on every backward outside
    ``no_sync``, whatever the world size (the reducer also moves gradients into its partitions).
    """

    every_micro_step: bool

    def grad_ready(self, param: torch.nn.Parameter) -> None: ...

    def finish(self) -> None: ...


def trainable(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Parameters that receive gradients, in order, without duplicates (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
