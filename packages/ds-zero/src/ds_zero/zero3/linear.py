"""``memory_efficient_linear``: ``nn.Linear`` layers of a ZeRO-3 model run through an autograd function that
saves the weight *parameter* for backward rather than the gathered tensor (``F.linear`` saves ``weight.t()``, a
view that would keep the whole weight alive from forward until backward, whatever the release schedule says).
The weight is gathered again before the layer's backward, so released weights really free their memory.

As in DeepSpeed, ``torch.nn.functional.linear`` itself is replaced by :func:`zero3_linear_wrap` process-wide while
a ZeRO-3 model with ``memory_efficient_linear`` lives (``F.linear(h, self.embed.weight)`` in a model's own forward
saves the parameter too); the builtin comes back when the last such model's hooks are removed (engine
``destroy``) or the last one is garbage-collected. Plain ``nn.Linear`` layers of the model are routed through
the function directly as well, so the saving holds even when another library replaced ``F.linear`` first (it is
then left alone).
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F

_TORCH_LINEAR = torch._C._nn.linear  # the builtin F.linear is; F.linear itself may be zero3_linear_wrap


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``x @ weight.T + bias`` saving ``weight`` itself for backward (DeepSpeed's name). Forward and
    ``setup_context`` are apart (and the vmap rule generated) so ``torch.func`` transforms can run it; backward
    runs under the autocast state the forward saw, as ``torch.amp.custom_bwd`` would."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _TORCH_LINEAR(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        # saving the parameter keeps a reference to the Parameter, not to its gathered storage
        ctx.save_for_backward(x, weight, bias)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        # torch.amp.custom_fwd's names for the forward's autocast state
        ctx._device_type = x.device.type
        ctx._fwd_used_autocast = torch.is_autocast_enabled(ctx._device_type)
        ctx._dtype = torch.get_autocast_dtype(ctx._device_type)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        with torch.autocast(ctx._device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast):
            x, weight, bias = ctx.saved_tensors
            gathered = _gather_if_released(weight)
            try:
                return _linear_grads(ctx, grad, x, weight, bias)
            finally:
                if gathered:
                    weight.partition()


def _gather_if_released(weight: torch.Tensor) -> bool:
    """A partitioned weight no schedule gathered for this backward (``F.linear`` on a parameter outside its
    module's hooks) is gathered here and released after."""
    status = getattr(weight, "ds_status", None)
    if status is None or getattr(status, "name", "") != "NOT_AVAILABLE":
        return False
    weight.all_gather()
    return True


def _linear_grads(ctx: Any, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple:
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    flat_grad = _rows(grad)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = grad.matmul(weight.to(grad.dtype)).to(x_dtype)
    if ctx.needs_input_grad[1]:
        grad_w = flat_grad.t().matmul(_rows(x).to(grad.dtype)).to(w_dtype)
    if bias is not None and ctx.needs_input_grad[2]:
        grad_b = flat_grad.sum(0).to(b_dtype)
    return grad_x, grad_w, grad_b


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dimension's rows (``reshape(-1, n)`` is ambiguous when ``t`` is empty: a
    layer with no output or input features, as a rank holding no attention head has)."""
    return t.reshape(1, -1) if t.dim() == 1 else t.flatten(0, -2)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return LinearFunctionForZeroStage3.apply(x, self.weight, self.bias)
    return _TORCH_LINEAR(x, self.weight, self.bias)


def zero3_linear_wrap(input: torch.Tensor, weight: torch.nn.Parameter,  # noqa: A002 - F.linear's signature
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` through the memory-efficient autograd function (DeepSpeed's name; any
    weight, as DeepSpeed's: its values and gradients are torch's)."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


_owners: set[int] = set()  # ids of the live schedulers that asked for the process-wide replacement


def install_functional_linear(owner: object) -> bool:
    """Make ``torch.nn.functional.linear`` :func:`zero3_linear_wrap` (when it is still the builtin) on behalf of
    ``owner`` until :func:`remove_functional_linear` for it, or until ``owner`` is garbage-collected (an engine
    dropped without ``destroy()`` must not keep torch patched). Returns whether ``F.linear`` is the wrapper now."""
    key = id(owner)
    if key not in _owners:
        _owners.add(key)
        weakref.finalize(owner, _release, key)
    if F.linear is _TORCH_LINEAR:
        F.linear = zero3_linear_wrap
    return F.linear is zero3_linear_wrap


def remove_functional_linear(owner: object) -> None:
    """``owner`` no longer needs the replacement; the last owner puts the builtin back (unless someone replaced
    the wrapper since)."""
    _release(id(owner))


def _release(key: int) -> None:
    _owners.discard(key)
    if not _owners and F.linear is zero3_linear_wrap:
        F.linear = _TORCH_LINEAR


def use_memory_efficient_linear(model: torch.nn.Module) -> int:
    """Route every plain ``nn.Linear`` (its own forward not overridden) with a partitioned weight through
    :class:`LinearFunctionForZeroStage3`; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward \
                and hasattr(module.weight, "ds_id") and "forward" not in module.__dict__:
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
