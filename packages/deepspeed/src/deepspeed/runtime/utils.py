"""``deepspeed.runtime.utils``: DeepSpeed's runtime helpers that client code imports (Megatron-DeepSpeed,
GPT-NeoX, Hugging Face): partitioning, seeding, memory reports, model-parallel norms and clipping.

The partitioning arithmetic is ds_pipe's (``partition_uniform``, ``partition_balanced``), the gradient norms follow
the engine's model-parallel counting rule (``runtime._norms``), the ``bwc_*`` lookups are ``deepspeed.utils.groups``'.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime._norms import (
    CheckOverflow,
    clip_grad_norm_,
    clip_tensors_by_global_norm,
    combine_grad_norm_groups,
    get_flattened_grad_norm,
    get_global_norm,
    get_global_norm_of_tensors,
    get_grad_norm,
    get_grad_zeros,
    get_weight_norm,
    has_inf_or_nan,
    is_invalid_grad_norm,
    is_model_parallel_parameter,
    mask_nan_or_inf_with_val_inplace,
)
from deepspeed.runtime._partitioned_tensor import PartitionedTensor
from deepspeed.utils.groups import (
    bwc_pipeline_parallel_group,
    bwc_pipeline_parallel_world_size,
    bwc_tensor_model_parallel_rank,
)
from deepspeed.utils.torch import required_torch_version
from ds_pipe.module import partition_balanced, partition_uniform
from ds_pipe.schedule import _call_to_str

__all__ = [
    "PartitionedTensor",
    "CheckOverflow", "DummyOptim", "align_dense_tensors", "bwc_pipeline_parallel_group",
    "bwc_pipeline_parallel_world_size", "bwc_tensor_model_parallel_rank", "call_to_str",
    "check_internal_apis_for_count_used_parameters", "clip_grad_norm_", "count_used_parameters_in_backward",
    "clip_tensors_by_global_norm", "combine_grad_norm_groups", "copy_to_device", "empty_cache",
    "ensure_directory_exists", "filter_empty_parameters", "get_flattened_grad_norm", "get_global_norm",
    "get_global_norm_of_tensors", "get_grad_norm", "get_grad_zeros", "get_ma_status", "get_only_unique_item",
    "get_tensor_bytes", "get_weight_norm", "has_inf_or_nan", "is_invalid_grad_norm", "is_model_parallel_parameter",
    "is_optimized_parameter", "mask_nan_or_inf_with_val_inplace", "maybe_loss_for_backward", "memory_status",
    "move_to_device", "noop_context", "noop_decorator", "partition_balanced", "partition_uniform", "prefix_sum_inc",
    "required_torch_version", "see_memory_usage", "set_random_seed", "OutputBackwardHookManager",
    "register_output_backward_hooks",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_GB = 1024**3


class DummyOptim:
    """Presents the model parameters as one param group: ZeRO-3 without an optimizer."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]


def filter_empty_parameters(params: Any) -> Any:
    """``params`` (a list of parameters or of param-group dicts) without parameters of 0 elements; groups left
    empty are dropped."""
    if not isinstance(params, (list, tuple)) or not params:
        return params
    if not isinstance(params[0], dict):
        return [p for p in params if p.numel() > 0]
    kept = []
    for group in params:
        nonempty = [p for p in group["params"] if p.numel() > 0]
        if nonempty:
            kept.append({**{k: v for k, v in group.items() if k != "params"}, "params": nonempty})
    return kept


def is_optimized_parameter(param: torch.nn.Parameter) -> bool:
    """Whether an optimizer wrapper owns ``param``: trainable and with at least one element (a ZeRO-3 parameter
    counts by its full ``ds_numel``)."""
    numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
    return param.requires_grad and numel > 0


def noop_decorator(func: _F) -> _F:
    return func


class noop_context:  # noqa: N801 - DeepSpeed's name
    """A context manager that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        return None


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold ``filename`` (a file path) if it does not exist yet."""
    dirname = os.path.dirname(filename)
    if dirname:
        os.makedirs(dirname, exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed ``random``, numpy (mod 2**32) and torch (mod 2**63)."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """A copy of ``item`` (tensors nested in lists, tuples and dicts) with the tensors matching ``criterion_func``
    on ``device``."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [copy_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """Move the tensors of ``item`` (nested in lists, tuples and dicts) to ``device``; with ``criterion_func``,
    only the matching ones, in place (their storage moves, so other references see the new device)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if criterion_func is None and hasattr(item, "to") else item


def prefix_sum_inc(weights: Iterable[float]) -> list[float]:
    """Inclusive prefix sum: ``[3, 4, 5] -> [3, 7, 12]``."""
    out: list[float] = []
    for w in weights:
        out.append(w + out[-1] if out else w)
    return out


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``base(arg, ..., key=value, ...)`` with ``repr`` values: the string of a call."""
    keywords = _call_to_str(base, **kwargs)
    if not args:
        return keywords
    positional = ", ".join(repr(arg) for arg in args)
    rest = keywords[len(base) + 1:-1]
    return f"{base}({positional}{', ' + rest if rest else ''})"


def get_only_unique_item(items: Iterable[Any]) -> Any:
    """The one distinct element of ``items``; RuntimeError when there are several (or none)."""
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def align_dense_tensors(tensor_list: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    """``tensor_list`` plus a zero tensor padding the total element count to a multiple of ``alignment``."""
    remaining = sum(t.numel() for t in tensor_list) % alignment
    if not remaining:
        return tensor_list
    pad = torch.zeros(alignment - remaining, device=tensor_list[0].device, dtype=tensor_list[0].dtype)
    return [*tensor_list, pad]


def get_tensor_bytes(item: Any) -> int:
    """Bytes of the tensors in ``item`` (nested in lists, tuples and dicts)."""
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, (list, tuple)):
        return sum(get_tensor_bytes(v) for v in item)
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    return 0


def maybe_loss_for_backward(value: Any) -> bool:
    """Whether ``value`` looks like a loss: a one-element tensor with a ``grad_fn``."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.grad_fn is not None


# ---- the backward pass now running ---------------------------------------------------------------------------
_GRAPH_TASK_APIS = ("_current_graph_task_id", "_will_engine_execute_node")


def check_internal_apis_for_count_used_parameters() -> bool:
    """Whether this torch has the autograd internals ``count_used_parameters_in_backward`` needs."""
    return (hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc")
            and all(hasattr(torch._C, name) for name in _GRAPH_TASK_APIS))


def count_used_parameters_in_backward(parameters: Iterable[Any]) -> int:
    """How many of ``parameters`` the backward pass now running will produce a gradient for.

    Call it from inside a backward hook. Parameters that do not require a gradient, or that share their
    gradient node with one already counted, count once or not at all. Unlike
    ``torch.autograd.graph.register_multi_grad_hook`` it never looks at shapes, so ZeRO-3's empty partitions
    are fine. Raises ``RuntimeError`` outside a backward pass or on a torch without the internals.
    """
    if not check_internal_apis_for_count_used_parameters():
        raise RuntimeError(f"count_used_parameters_in_backward needs torch.autograd.graph._get_grad_fn_or_grad_acc "
                           f"and torch._C.{'/'.join(_GRAPH_TASK_APIS)}, which torch {torch.__version__} lacks")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called while a backward pass runs "
                           "(from a backward hook)")
    nodes: dict[Any, None] = {}  # insertion-ordered set of gradient nodes
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        # backward hooks run with grad mode off, and a leaf's accumulator lookup needs it on (torch <= 2.4)
        with torch.enable_grad():
            node = torch.autograd.graph._get_grad_fn_or_grad_acc(param)
        if node is not None:
            nodes[node] = None
    return sum(1 for node in nodes if torch._C._will_engine_execute_node(node))


# ---- memory reports ------------------------------------------------------------------------------------------
def _is_rank0_or_single() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def empty_cache() -> None:
    """Release the accelerator's cached memory and reset its peak statistics."""
    get_accelerator().empty_cache()
    get_accelerator().reset_peak_memory_stats()


def _host_memory_line() -> str:
    from deepspeed.accelerator import CPU_Accelerator

    host = CPU_Accelerator()
    total = host.total_memory()
    used = total - host.available_memory()
    return f"CPU Virtual Memory:  used = {round(used / _GB, 2)} GB, percent = {round(100.0 * used / total, 1)}%"


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, print ``message`` and the accelerator's allocated/reserved memory (current and peak, GB)
    and the host's used memory, on rank 0 (or without torch.distributed); then reset the peak statistics."""
    if not force or not _is_rank0_or_single():
        return
    gc.collect()  # reclaim garbage first, so the numbers are what is really held
    acc = get_accelerator()
    print(message)
    print(f"MA {round(acc.memory_allocated() / _GB, 2)} GB         "
          f"Max_MA {round(acc.max_memory_allocated() / _GB, 2)} GB         "
          f"CA {round(acc.memory_reserved() / _GB, 2)} GB         "
          f"Max_CA {round(acc.max_memory_reserved() / _GB)} GB ")
    print(_host_memory_line())
    acc.reset_peak_memory_stats()


_last_status = {"allocated": 0, "cached": 0}


def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
    """Print this rank's allocated/cached accelerator memory and the change since the previous call (GB)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if print_rank != -1 and rank != print_rank:
        return
    acc = get_accelerator()
    acc.synchronize()
    if reset_max:
        acc.reset_max_memory_cached()
        acc.reset_max_memory_allocated()
    allocated, cached = acc.memory_allocated(), acc.memory_cached()
    delta_a, delta_c = allocated - _last_status["allocated"], cached - _last_status["cached"]
    _last_status.update(allocated=allocated, cached=cached)
    print(f"RANK={rank} MEMSTATS", msg, f"device={acc.current_device_name()} "
          f"current alloc={allocated / _GB:0.4f}GB (delta={delta_a / _GB:0.4f}GB "
          f"max={acc.max_memory_allocated() / _GB:0.4f}GB) current cache={cached / _GB:0.4f}GB "
          f"(delta={delta_c / _GB:0.4f}GB max={acc.max_memory_cached() / _GB:0.4f}GB)")


def get_ma_status() -> int:
    """Bytes allocated on the accelerator (0 on ranks other than 0)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return 0
    return get_accelerator().memory_allocated()


class OutputBackwardHookManager:
    """Gradient hooks on a forward's output tensors: ``preprocess_once_fn()`` runs when the backward first reaches
    any of them (once per backward), ``preprocess_per_tensor_fn(grad)`` (when given) maps each output's gradient.
    The manager lives as long as the outputs do (each hook holds it)."""

    def __init__(self, preprocess_once_fn: Callable[[], None],
                 preprocess_per_tensor_fn: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.preprocess_once_fn = preprocess_once_fn
        self.preprocess_per_tensor_fn = preprocess_per_tensor_fn
        self.hook_handles: list[Any] = []
        self._ran = False

    def _hook(self, grad: torch.Tensor) -> Any:
        if not self._ran:
            self._ran = True
            self.preprocess_once_fn()
        return None if self.preprocess_per_tensor_fn is None else self.preprocess_per_tensor_fn(grad)

    def register_hooks_on_outputs(self, outputs: Any) -> None:
        if isinstance(outputs, torch.Tensor):
            if outputs.requires_grad:
                self.hook_handles.append(outputs.register_hook(self._hook))
        elif isinstance(outputs, (list, tuple)):
            for value in outputs:
                self.register_hooks_on_outputs(value)
        elif isinstance(outputs, dict):
            for value in outputs.values():
                self.register_hooks_on_outputs(value)


def register_output_backward_hooks(outputs: Any, preprocess_once_fn: Callable[[], None],
                                   preprocess_per_tensor_fn: Callable[[torch.Tensor], Any] | None = None
                                   ) -> OutputBackwardHookManager:
    """DeepSpeed's helper: an :class:`OutputBackwardHookManager` with hooks on every output that needs a gradient."""
    manager = OutputBackwardHookManager(preprocess_once_fn, preprocess_per_tensor_fn)
    manager.register_hooks_on_outputs(outputs)
    return manager
