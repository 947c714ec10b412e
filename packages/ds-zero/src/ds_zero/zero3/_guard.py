"""A clear error instead of silently wrong values when a released ZeRO-3 parameter is computed with.

While released, a partitioned parameter's ``.data`` is an empty tensor: ``weight.sum()`` would be 0 and
``weight.fill_(1.0)`` would change nothing, without a word. Partitioned parameters therefore become a
``Parameter`` subclass whose ``__torch_function__`` refuses computation on a released parameter, naming it and
``GatheredParameters``. What does not read the values stays allowed: attributes (``.data``, ``.grad``,
``.shape``, ``.dtype``), metadata (``numel()``, ``dim()``), moves and casts (``Module.to`` converts released
parameters), ``detach()`` (``state_dict``), hashing and hooks. Inside a gather, or for persistent parameters, the
subclass only passes the call through; so it does for DeepCompile's ``torch.ops.dc`` operators, which are meant to
take released parameters.
"""

from __future__ import annotations

from typing import Any

import torch

_ALLOWED = frozenset({
    "__get__", "__set__", "__delete__",  # attribute access: .data, .grad, .shape, .dtype, .device, ...
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "is_pinned", "get_device", "data_ptr", "untyped_storage", "storage", "_typed_storage",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "_is_view",
    "detach", "detach_", "to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type", "type_as",
    "pin_memory", "share_memory_", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
    "__hash__", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__setstate__", "__getstate__",
    "__dir__", "__sizeof__", "_make_subclass", "as_subclass",
})


def _released(value: Any) -> torch.nn.Parameter | None:
    if isinstance(value, PartitionedParameter) and value.ds_status.name != "AVAILABLE" and value.ds_numel:
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _released(item)
            if found is not None:
                return found
    return None


# Set by ``zero.Init`` while it builds modules: an in-place write into a released parameter there (a constructor
# initialising a child module's weight after registering it, as ``nn.MultiheadAttention`` does for ``out_proj``)
# runs on the gathered value (``writer(param, op)``), which is cut into partitions again, instead of failing.
construction_writer: Any = None


class PartitionedParameter(torch.nn.Parameter):
    """The class of a ZeRO-3 partitioned ``torch.nn.Parameter`` (``isinstance(p, nn.Parameter)`` holds)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "dc":
            # DeepCompile's operators take released parameters by design (allgather_param reads the partition)
            return _plain(func, args, kwargs)
        name = getattr(func, "__name__", "")
        # torch's private helpers (``_has_compatible_shallow_copy_type`` in Module.to, ...) inspect, not compute
        if name not in _ALLOWED and not (name.startswith("_") and not name.startswith("__")):
            if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].numel() == 0:
                return _plain(func, args, kwargs)  # an empty value into a released one (a stage-3 state_dict load)
            param = _released(args)  # never `a or b`: a tensor's truth value is itself a torch function
            if param is None:
                param = _released(list(kwargs.values()))
            if param is not None and construction_writer is not None and name.endswith("_") \
                    and not name.startswith("_"):
                return construction_writer(param, lambda: _plain(func, args, kwargs))
            if param is not None:
                raise RuntimeError(
                    f"ZeRO-3: parameter {getattr(param, 'ds_name', None) or '<unnamed>'} (ds_id {param.ds_id}, "
                    f"shape {tuple(param.ds_shape)}) is partitioned across ranks and not gathered, so "
                    f"{name or func}() on it would see an empty tensor. Gather it first: "
                    "with deepspeed.zero.GatheredParameters(param): ... (or register it with "
                    "deepspeed.zero.register_external_parameter(module, param) if a module's forward uses it)")
        return _plain(func, args, kwargs)


def _plain(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def guard(param: torch.nn.Parameter) -> None:
    """Make ``param`` a :class:`PartitionedParameter` (plain ``Parameter`` objects only: other subclasses keep their
    own class and behaviour)."""
    if type(param) is torch.nn.Parameter:
        param.__class__ = PartitionedParameter
