"""The ``torch.ops.dc`` operators (DeepSpeed's schemas) that DeepCompile's passes insert into captured graphs.

They are inserted after AOT autograd has split forward and backward, so they are never differentiated or
functionalized; each forwards to the :class:`~deepspeed.compile.custom_ops.handle.DeepCompileHandle` of the engine
that compiled its graph (``compile.state.get_handle(graph_id)``).
``register()`` defines them once per process (``get_deepcompile_handle`` calls it).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.compile.state import get_handle

_SCHEMAS = {
    "allgather_param": "allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype=None) -> Tensor",
    "prefetch_params_fused": "prefetch_params_fused(int graph_id, Tensor[] params, int[] ids, "
                             "ScalarType?[] dtypes) -> ()",
    "wait_allgather": "wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)",
    "release_param": "release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)",
    "reduce_grad": "reduce_grad(Tensor a, int graph_id, int id) -> Tensor",
    "free_tensors": "free_tensors(Tensor[] a) -> ()",
    "offload_tensor": "offload_tensor(Tensor a, int id, int id2) -> Tensor",
    "reload_tensor": "reload_tensor(Tensor a, int id, int id2) -> Tensor",
    "wait_offload": "wait_offload(Tensor a, int id, int id2) -> Tensor",
    "wait_reload": "wait_reload(Tensor a, int id, int id2) -> Tensor",
    "offload_parameter": "offload_parameter(Tensor a, int id, int id2) -> ()",
    "reload_parameter": "reload_parameter(Tensor a, int id, int id2) -> ()",
    "end_backward": "end_backward(Any deps, int graph_id, bool release_reduce_buckets) -> ()",
}

_lib: Any = None
# ops with no tensor output (or an aliasing one) must survive dead-code elimination
SIDE_EFFECT_OPS = ("prefetch_params_fused", "release_param", "reduce_grad", "free_tensors", "offload_parameter",
                   "reload_parameter", "end_backward", "wait_allgather")


def _handle(graph_id: int) -> Any:
    """The handle of the engine that compiled graph ``graph_id`` (every operator carries its graph's id)."""
    return get_handle(graph_id)


def _allgather(a: torch.Tensor, graph_id: int, ds_id: int, dtype: Any = None) -> torch.Tensor:
    return _handle(graph_id).allgather_param(graph_id, ds_id, dtype)


def _allgather_fake(a: torch.Tensor, graph_id: int, ds_id: int, dtype: Any = None) -> torch.Tensor:
    shape = _handle(graph_id).param_shape(ds_id)
    return a.new_empty(shape, dtype=dtype or a.dtype)


# c10's ScalarType numbering: a ``ScalarType?[]`` argument reaches a Python kernel as these ints, not as dtypes.
_SCALAR_TYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                 torch.float64, torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.qint8,
                 torch.quint8, torch.qint32, torch.bfloat16)


def _prefetch(graph_id: int, params: list, ids: list, dtypes: list) -> None:
    for ds_id, dtype in zip(ids, dtypes, strict=False):
        _handle(graph_id).allgather_param(graph_id, ds_id, _SCALAR_TYPES[dtype] if isinstance(dtype, int) else dtype)


def _wait(a: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    return a  # gathers complete synchronously here


def _release(a: torch.Tensor, graph_id: int, ds_id: int, n_users: int) -> torch.Tensor:
    _handle(graph_id).release_param(graph_id, ds_id, n_users)
    return a


def _reduce(a: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    _handle(graph_id).reduce_grad(a, graph_id, ds_id)
    return a.new_empty(0)


def _reduce_fake(a: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    return a.new_empty(0)


def _free(a: list) -> None:
    for t in a:
        t.data = t.new_empty(0)


def _offload(a: torch.Tensor, graph_id: int, key: int) -> torch.Tensor:
    return _handle(graph_id).offload_tensor(a, graph_id, key)


def _reload(a: torch.Tensor, graph_id: int, key: int) -> torch.Tensor:
    return _handle(graph_id).reload_tensor(a, graph_id, key)


def _identity3(a: torch.Tensor, graph_id: int, key: int) -> torch.Tensor:
    return a


def _like3(a: torch.Tensor, graph_id: int, key: int) -> torch.Tensor:
    return torch.empty_like(a)


def _offload_param(a: torch.Tensor, graph_id: int, ds_id: int) -> None:
    _handle(graph_id).offload_parameter(graph_id, ds_id)


def _reload_param(a: torch.Tensor, graph_id: int, ds_id: int) -> None:
    _handle(graph_id).reload_parameter(graph_id, ds_id)


def _end_backward(deps: Any, graph_id: int, release_reduce_buckets: bool) -> None:
    _handle(graph_id).end_backward(graph_id, release_reduce_buckets)


def _nothing(*args: Any) -> None:
    return None


def _wait_fake(a: torch.Tensor, *args: Any) -> torch.Tensor:
    return a


_IMPLS = {
    "allgather_param": (_allgather, _allgather_fake),
    "prefetch_params_fused": (_prefetch, _nothing),
    "wait_allgather": (_wait, _wait_fake),
    "release_param": (_release, _wait_fake),
    "reduce_grad": (_reduce, _reduce_fake),
    "free_tensors": (_free, _nothing),
    "offload_tensor": (_offload, _like3),
    "reload_tensor": (_reload, _like3),
    "wait_offload": (_identity3, _wait_fake),
    "wait_reload": (_identity3, _wait_fake),
    "offload_parameter": (_offload_param, _nothing),
    "reload_parameter": (_reload_param, _nothing),
    "end_backward": (_end_backward, _nothing),
}


def register() -> None:
    """Define the ``dc`` operators (once per process; a library already defining them is reused)."""
    global _lib
    if _lib is not None or hasattr(torch.ops.dc, "allgather_param"):
        return
    lib = torch.library.Library("dc", "DEF")  # noqa: TOR901 - kept for the life of the process
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        impl, fake = _IMPLS[name]
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"dc::{name}", fake, lib=lib)
    _lib = lib
    for name in SIDE_EFFECT_OPS:
        torch.fx.node.has_side_effect(getattr(torch.ops.dc, name).default)
