"""DeepCompile's runtime (DeepSpeed's compiled ``dc`` extension, here in Python over ``torch.distributed``).

It holds what the ``torch.ops.dc`` operators of a compiled graph act on:
- the registered ZeRO-3 parameters (``register_z3_param``): ``allgather_param`` builds a parameter's whole value
  from every rank's partition (``ds_tensor``) over its data-parallel group and keeps it until ``release_param``
  (a persistent one, ``set_persistent``, stays gathered until ``invalidate_gathered_param`` / ``reset``);
- the gradient sink (``set_grad_sink``): ``reduce_grad`` hands each whole gradient the backward graph computes to
  the engine's reducer (ZeRO-3: the reduce-scatter into the gradient partitions; ZeRO-1/2: the bucketed
  reduction), so the graph itself returns no gradient for a partitioned parameter;
- offloaded tensors (``offload_tensor`` / ``reload_tensor``), keyed by ``(graph_id, id)``.

Ownership: a gathered value is owned by the handle from ``allgather_param`` to ``release_param``; the graph reads
it in between. Everything runs synchronously on the calling thread, so ``wait_*`` operators return at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _Z3Param:
    param: torch.nn.Parameter
    persistent: bool = False
    grad_dtype: torch.dtype | None = None


@dataclass
class DeepCompileHandle:
    """One engine's DeepCompile runtime (see the module docstring); ``compile.state`` holds one per engine."""

    group: Any = None
    config: Any = None
    reduce_bucket_size: int = 0
    params: dict[int, _Z3Param] = field(default_factory=dict)
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)
    graphs: dict[int, list[int]] = field(default_factory=dict)
    offloaded: dict[tuple[int, int], tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    grad_sink: Callable[[torch.nn.Parameter, torch.Tensor], None] | None = None
    profiling: bool = False
    in_backward: bool = False
    boundary: bool = True
    gathers: int = 0  # allgathers run (a count for tests and the profiler)

    # ---- setup ---------------------------------------------------------------------------------------------
    def init(self, group: Any, config: Any, reduce_bucket_size: int = 0) -> None:
        self.group, self.config, self.reduce_bucket_size = group, config, reduce_bucket_size

    def set_grad_sink(self, sink: Callable[[torch.nn.Parameter, torch.Tensor], None] | None) -> None:
        self.grad_sink = sink

    def register_z3_param(self, param: torch.nn.Parameter, persistent: bool = False,
                          grad_dtype: torch.dtype | None = None) -> None:
        self.params[param.ds_id] = _Z3Param(param, persistent, grad_dtype)

    def register_param(self, param: torch.nn.Parameter) -> None:
        """A ZeRO-1/2 parameter whose gradient ``reduce_grad`` receives (keyed by ``param.param_id``)."""
        self.params[param.param_id] = _Z3Param(param)

    def register_graph_z3(self, graph_id: int, ds_ids: list[int]) -> None:
        self.graphs[graph_id] = list(ds_ids)

    def set_persistent(self, ds_id: int) -> None:
        self.params[ds_id].persistent = True

    def enable_profiling(self, enable: bool) -> None:
        self.profiling = enable

    def is_profiling(self) -> bool:
        return self.profiling

    def param_shape(self, ds_id: int) -> torch.Size:
        return self.params[ds_id].param.ds_shape

    # ---- the step ------------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        self.in_backward = False

    def end_forward(self) -> None:
        pass

    def start_backward(self, is_gradient_accumulation_boundary: bool) -> None:
        self.in_backward, self.boundary = True, is_gradient_accumulation_boundary

    def end_backward(self, graph_id: int, release_reduce_buckets: bool = True) -> None:
        """Every ``reduce_grad`` of ``graph_id`` ran; the engine's end of backward completes the reduction."""

    def invalidate_gathered_param(self, ds_id: int) -> None:
        """The partition changed (optimizer step): a kept whole value is stale."""
        self.gathered.pop(ds_id, None)

    def clear_all_gathered_params(self) -> None:
        self.gathered.clear()

    def reset(self) -> None:
        """A new compile cycle: forget graphs and gathered values (parameters stay registered)."""
        self.graphs.clear()
        self.gathered.clear()
        self.offloaded.clear()

    def cleanup(self) -> None:
        """The engine is gone: forget everything."""
        self.reset()
        self.params.clear()
        self.grad_sink = None
        self.gathers = 0

    # ---- operators -----------------------------------------------------------------------------------------
    def allgather_param(self, graph_id: int, ds_id: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        kept = self.gathered.get(ds_id)
        if kept is not None and (dtype is None or kept.dtype == dtype):
            return kept
        entry = self.params.get(ds_id)
        if entry is None:
            raise RuntimeError(f"DeepCompile: allgather_param of parameter ds_id={ds_id}, which no engine "
                               "registered (was the engine destroyed, or the graph compiled for another engine?)")
        full = _gather_whole(entry.param)
        if dtype is not None and full.dtype != dtype:
            full = full.to(dtype)
        self.gathers += 1
        self.gathered[ds_id] = full
        return full

    def release_param(self, graph_id: int, ds_id: int, n_users: int = 1) -> None:
        entry = self.params.get(ds_id)
        if entry is not None and entry.persistent:
            return
        self.gathered.pop(ds_id, None)

    def reduce_grad(self, grad: torch.Tensor, graph_id: int, ds_id: int) -> None:
        if self.profiling:  # a profiling run of the backward graph: its gradients are not the step's
            return
        entry = self.params.get(ds_id)
        if entry is None or self.grad_sink is None:
            raise RuntimeError(f"DeepCompile: reduce_grad for parameter id {ds_id} with no engine to receive it")
        if entry.grad_dtype is not None and grad.dtype != entry.grad_dtype:
            grad = grad.to(entry.grad_dtype)
        self.grad_sink(entry.param, grad)

    def offload_tensor(self, tensor: torch.Tensor, graph_id: int, key: int) -> torch.Tensor:
        host = tensor.detach().to("cpu", copy=True)
        self.offloaded[(graph_id, key)] = (host, tensor.device)
        return host

    def reload_tensor(self, tensor: torch.Tensor, graph_id: int, key: int) -> torch.Tensor:
        host, device = self.offloaded.pop((graph_id, key), (tensor, tensor.device))
        return host.to(device, copy=True)

    def offload_parameter(self, graph_id: int, ds_id: int) -> None:
        p = self.params[ds_id].param
        p.ds_tensor = p.ds_tensor.to("cpu")

    def reload_parameter(self, graph_id: int, ds_id: int) -> None:
        p = self.params[ds_id].param
        p.ds_tensor = p.ds_tensor.to(p.device)


def _gather_whole(param: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's whole value from every rank's partition, on the parameter's compute device."""
    space = param.ds_space
    part = param.ds_tensor.detach().to(space.compute_device)
    if space.world == 1:
        flat = part
    else:
        flat = part.new_empty(space.world * part.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(flat, part.contiguous(), group=space.group)
    return flat[:param.ds_numel].view(param.ds_shape)
