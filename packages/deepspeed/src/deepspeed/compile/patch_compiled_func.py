"""Capture the real inputs of compiled backward graphs, so DeepCompile can profile and rewrite a backward graph
with real values when AOT autograd compiles it lazily (at the first backward).

While patched (``patch_compiled_func``), ``torch.autograd.Function`` is a subclass whose metaclass wraps the
backward entry of every ``CompiledFunction`` class AOT autograd creates (``_backward_impl`` on PyTorch >= 2.7,
``_backward_prologue`` before): each call appends its arguments under the frame key registered for that class
(``register_backward_frame``, in creation order) and drops the class's compiled backward so the next backward
compiles again. ``unpatch_compiled_func`` restores ``torch.autograd.Function`` and drops every captured input.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from deepspeed.utils.torch import required_torch_version

backward_inputs: dict[Hashable, list[Any]] = {}
backward_frame_keys: deque = deque()

enabled_patched_func = False
original_grad_fn: Any = None
_BaseMeta = type(torch.autograd.Function)
_NEW_ENTRY = required_torch_version(min_version=2.7)  # which method receives the backward's inputs


def _plain_function(method: Any) -> Any:
    """The function behind a ``staticmethod`` (not callable itself before Python 3.10)."""
    return method.__func__ if isinstance(method, staticmethod) else method


def _capturing(entry: Any, frame_key: Hashable | None) -> Any:
    """``entry`` (the class's backward entry) recording its backward inputs under ``frame_key``."""

    def record(all_args: Any, owner: Any) -> None:
        if enabled_patched_func and frame_key is not None:
            backward_inputs.setdefault(frame_key, []).append(all_args)
            owner.compiled_bw = None  # compile the backward again, from these inputs

    if _NEW_ENTRY:

        def backward_impl(ctx: Any, all_args: Any) -> Any:
            record(all_args, backward_impl.owner_class)
            return entry(ctx, all_args)

        wrapper = backward_impl
    else:

        def backward_prologue(ctx: Any, *grad_outputs: Any) -> Any:
            all_args = entry(ctx, *grad_outputs)
            record(all_args, backward_prologue.owner_class)
            return all_args

        wrapper = backward_prologue
    wrapper.owner_class = None
    return wrapper


class FunctionMeta(_BaseMeta):
    """Metaclass of the patched ``torch.autograd.Function``: wraps ``CompiledFunction`` classes as they are made."""

    def __new__(mcs, name: str, bases: tuple, namespace: dict) -> Any:
        if name != "CompiledFunction":
            return super().__new__(mcs, name, bases, namespace)
        attr = "_backward_impl" if _NEW_ENTRY else "_backward_prologue"
        entry = _plain_function(namespace.get(attr))
        frame_key = backward_frame_keys.popleft() if backward_frame_keys else None
        wrapper = _capturing(entry, frame_key)
        namespace[attr] = staticmethod(wrapper)
        cls = super().__new__(mcs, name, bases, namespace)
        wrapper.owner_class = cls
        return cls


def patch_compiled_func() -> dict[Hashable, list[Any]]:
    """Start capturing (idempotent); returns the captured-inputs table."""
    global enabled_patched_func, original_grad_fn
    enabled_patched_func = True
    if original_grad_fn is None:
        original_grad_fn = torch.autograd.Function

        class PatchedFunction(original_grad_fn, metaclass=FunctionMeta):
            pass

        torch.autograd.Function = PatchedFunction
    return backward_inputs


def register_backward_frame(frame_key: Hashable) -> None:
    """The next ``CompiledFunction`` class AOT autograd creates belongs to ``frame_key``."""
    backward_frame_keys.append(frame_key)


def unpatch_compiled_func() -> None:
    """Restore ``torch.autograd.Function`` and drop every captured input and pending registration."""
    global enabled_patched_func, original_grad_fn
    enabled_patched_func = False
    if original_grad_fn is not None:
        torch.autograd.Function = original_grad_fn
        original_grad_fn = None
    clear_backward_inputs()


def get_backward_inputs(frame_key: Hashable | None = None) -> Any:
    """The whole table, or the inputs captured for ``frame_key`` (a list, empty when none)."""
    if frame_key is None:
        return backward_inputs
    return backward_inputs.get(frame_key, [])


def pop_backward_input(frame_key: Hashable) -> Any:
    """The latest inputs captured for ``frame_key`` (removed), or None."""
    captured = backward_inputs.get(frame_key)
    if not captured:
        return None
    inputs = captured.pop()
    if not captured:
        del backward_inputs[frame_key]
    return inputs


def clear_backward_inputs(frame_keys: Iterable[Hashable] | None = None) -> None:
    """Drop the captured inputs and pending registrations of ``frame_keys`` (all when None)."""
    if frame_keys is None:
        backward_inputs.clear()
        backward_frame_keys.clear()
        return
    dropped = set(frame_keys)
    for key in dropped:
        backward_inputs.pop(key, None)
    kept = [key for key in backward_frame_keys if key not in dropped]
    backward_frame_keys.clear()
    backward_frame_keys.extend(kept)
