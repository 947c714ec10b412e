"""``get_model_profile``: profile one forward, ``generate()`` or training-step call of a model."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ds_profiler._format import macs_to_string, number_to_string, params_to_string
from ds_profiler._profiler import FlopsProfiler, ignore_types

MODES = ("forward", "generate", "train")


def _example_input(model: nn.Module, input_shape: Any) -> torch.Tensor:
    """A random tensor of ``input_shape`` with the model's floating dtype and device."""
    if not isinstance(input_shape, (tuple, list)) or not input_shape or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input_shape
    ):
        raise ValueError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape!r}")
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.get_default_dtype()
    device = first.device if first is not None else None
    return torch.randn(tuple(input_shape), dtype=dtype, device=device)


def find_loss(output: Any) -> torch.Tensor | None:
    """The tensor to differentiate in ``mode='train'``: ``output.loss`` or ``output['loss']`` when present
    (Hugging Face outputs), else the first floating tensor that requires grad."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad and output.is_floating_point() else None
    values = output.values() if isinstance(output, Mapping) else output
    if isinstance(values, (tuple, list)) or isinstance(output, Mapping):
        for value in values:
            found = find_loss(value)
            if found is not None:
                return found
    return None


def _training_step(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Forward + backward; the model's existing ``.grad`` tensors are restored afterwards."""
    saved = [(p, p.grad) for p in model.parameters()]
    try:
        output = model(*args, **kwargs)
        loss = find_loss(output)
        if loss is None:
            raise ValueError("mode='train' needs the model output to hold a floating tensor that requires grad "
                             "(or a .loss); got " + type(output).__name__)
        loss.float().sum().backward()
    finally:
        for param, grad in saved:
            param.grad = grad


def _call(model: nn.Module, mode: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if mode == "forward":
        model(*args, **kwargs)
    elif mode == "generate":
        model.generate(*args, **kwargs)
    else:
        _training_step(model, args, kwargs)


def _check_call(model: Any, mode: str, args: Any, kwargs: Any, warm_up: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; expected one of {MODES}")
    if mode == "generate" and not callable(getattr(model, "generate", None)):
        raise ValueError(f"mode='generate' needs a model with a generate() method; {type(model).__name__} has none")
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"args must be a list of positional arguments, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"warm_up must be an integer >= 0, got {warm_up!r}")


def get_model_profile(
    model: nn.Module,
    input_shape: tuple | None = None,
    args: Sequence[Any] = [],  # noqa: B006 - the documented signature
    kwargs: Mapping[str, Any] = {},  # noqa: B006 - the documented signature
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """Profile ``model`` and return ``(flops, macs, params)``.

    ``mode='forward'`` profiles one call ``model(*args, **kwargs)`` (or ``model(x)`` with ``x`` random of
    ``input_shape``), ``'generate'`` one ``model.generate(...)`` call (all forwards it makes), ``'train'`` one
    forward plus backward step, whose flops/MACs are then forward + backward. ``warm_up`` untimed calls run
    first. Nothing stays attached to the model or to torch afterwards, also when the call raises.
    """
    _check_call(model, mode, args, kwargs, warm_up)
    ignore = ignore_types(ignore_modules, "ignore_modules")
    if input_shape is not None:
        args = [_example_input(model, input_shape)]
    elif not args and not kwargs:
        raise ValueError("give input_shape, or args and/or kwargs for the model call")
    for _ in range(warm_up):
        _call(model, mode, args, kwargs)
    prof = FlopsProfiler(model)
    try:
        prof.start_profile(ignore_list=list(ignore))
        _call(model, mode, args, kwargs)
        prof.stop_profile()
        flops, macs = prof.get_total_flops(), prof.get_total_macs()
        if mode == "train":
            flops, macs = flops + prof.get_total_backward_flops(), macs + prof.get_total_backward_macs()
        params = prof.get_total_params()
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
