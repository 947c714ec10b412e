"""Dynamo traces a released ZeRO-3 parameter (``data`` empty) as its whole shape (``ds_shape``).

While patched, the fake tensor Dynamo and AOT autograd make for a parameter with a ``ds_id`` is built from a
stand-in of the whole shape, so the captured graph computes with whole parameters (the ``zero3_compile`` pass
then gathers them in the graph), while the guards Dynamo installs still describe the released parameter the
compiled code will be called with (empty ``data``), so releasing it does not trigger recompilation.
"""

from __future__ import annotations

from typing import Any

import torch

_installed: dict[str, Any] = {}


def wrap_if_ds_param(t: Any) -> Any:
    """A whole-shape stand-in (zeros) for a ZeRO-3 parameter; anything else unchanged."""
    if not hasattr(t, "ds_id"):
        return t
    stand_in = torch.zeros(t.ds_shape, dtype=t.dtype, device=t.device)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(stand_in, requires_grad=t.requires_grad)
    return stand_in.requires_grad_(t.requires_grad)


def patch_fake_tensor() -> None:
    """Install the patches (idempotent; they only change the handling of tensors with a ``ds_id``)."""
    if _installed:
        return
    from torch._dynamo.variables import builder
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original_wrap = builder.wrap_to_fake_tensor_and_record
    original_from_tensor = FakeTensorMode.from_tensor

    def wrap_to_fake_tensor_and_record(e: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(e, "ds_id"):
            return original_wrap(e, *args, **kwargs)
        stand_in = wrap_if_ds_param(e)
        fake = original_wrap(stand_in, *args, **kwargs)
        context = torch._guards.TracingContext.try_get()
        if context is not None and stand_in in context.tensor_to_context:
            context.tensor_to_context[e] = context.tensor_to_context.pop(stand_in)
        tx = kwargs.get("tx", args[0] if args else None)
        source = kwargs.get("source")
        if source is not None and tx is not None:
            released = torch.empty(0, dtype=e.dtype, device=e.device)  # what the guards will see at call time
            tx.output.input_source_to_sizes_strides[source] = {"size": released.size(), "stride": released.stride()}
        return fake

    def from_tensor(self: Any, t: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(t, "ds_id"):
            return original_from_tensor(self, t, *args, **kwargs)
        with unset_fake_temporarily():
            return original_from_tensor(self, wrap_if_ds_param(t), *args, **kwargs)

    builder.wrap_to_fake_tensor_and_record = wrap_to_fake_tensor_and_record
    FakeTensorMode.from_tensor = from_tensor
    _installed.update(wrap=(builder, original_wrap), from_tensor=(FakeTensorMode, original_from_tensor))


def unpatch_fake_tensor() -> None:
    """Put torch's functions back."""
    if not _installed:
        return
    builder, wrap = _installed.pop("wrap")
    builder.wrap_to_fake_tensor_and_record = wrap
    mode, from_tensor = _installed.pop("from_tensor")
    mode.from_tensor = from_tensor
