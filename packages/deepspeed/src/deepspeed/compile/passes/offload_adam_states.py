"""DeepCompile pass ``offload_adam_states``: keep the optimizer's states (Adam's moments and the fp32 master
partitions) in host memory during forward and backward, and bring them back for the optimizer step, moving only
as many as the device's memory budget requires.

Three schedule entries share this module:

- ``offload_adam_states_for_init`` (``NAME_FOR_INIT``): moves every state out before the graphs are profiled, so
  the profiled per-node peaks describe the run with the states already gone (the *floor*).
- ``offload_adam_states`` (``NAME``, :func:`move_opt_states`): plans against that floor. Walking the first forward
  graph, it schedules states to leave (front of the task list first) until the budget holds at every node, and
  puts one ``dc.offload_opt_launch`` per scheduled state at the head of the graph. In backward it brings each
  one back (``dc.reload_opt``) as soon as the budget has room for it, the rest before the last backward graph's
  output, followed by ``dc.reload_copy_stream_sync``, so the optimizer step reads resident states.
- ``offload_adam_states_sync`` (``NAME_SYNC``, :func:`move_opt_states_sync`): the same ops without a profile:
  everything leaves at the head of the first forward graph and returns at the end of backward.

The ops take only a tensor anchor and an integer: the index of the state's task in ``_op_task_registry`` (live
tensors never cross the operator boundary, so graphs containing them can be traced, compiled and cached). They
return nothing, so they are registered side-effectful (FX's dead-code elimination) and with an ORDERED effect
(inductor's scheduler would drop them otherwise, and the reload-then-sync order matters).

Buffer ownership: a state's device tensor belongs to the compute stream until ``offload_opt_launch`` (which first
waits for the compute stream, the optimizer having just written it); the copy to its host buffer runs on
``copy_stream`` and ``record_stream`` keeps the device block alive until the copy lands, so the state entry is
deleted at once. A reload allocates a new device tensor after the compute stream's work so far, fills it on
``copy_stream``, and publishes it in the state; ``reload_copy_stream_sync`` drains ``copy_stream`` before the
graph returns, so the optimizer step never reads a half-copied state. On a device without streams (the CPU) the
copies are synchronous. The moves are exact copies: a state comes back bitwise equal.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any, NamedTuple

import torch
from torch.fx import Graph, GraphModule

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_states import _make_offload_state_key
from deepspeed.utils import logger

from .contract import CAP_OPT_STATES_EVICTED, PassContract

try:
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
except ImportError:  # a torch without the effects registry: only FX's side-effect set protects the ops
    _register_effectful_op = None

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"
# The states are registered by init_z3 only, and a run has one offload target.
_INCOMPATIBLE = frozenset({"offload_parameters", "zero1_compile", "zero2_compile"})
# Planning reads peaks that are only meaningful if they were profiled with the states already out.
CONTRACT = PassContract(requires=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
# Needs no profile; it replaces the planning variant.
CONTRACT_SYNC = PassContract(conflicts_with=_INCOMPATIBLE | {NAME})
CONTRACT_FOR_INIT = PassContract(provides=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)

# Share of device memory kept free when no budget override is given (allocator slack, fragmentation).
MARGIN = 0.2
BUDGET_ENV = "DS_DC_OFFLOAD_OPT_BUDGET_GB"
HP_PARAM = "hp_param"

# Set by init_offload_opt_states: the ZeRO-3 optimizer (``state``, ``fp32_partitioned_groups_flat``), the
# compute device and the DeepCompile handle (``is_profiling``).
optimizer: Any = None
device: torch.device | None = None
nz3: Any = None

# None on a device without streams (the CPU): copies are then synchronous.
copy_stream: Any = None
offload_event: Any = None
reload_event: Any = None


class _Task(NamedTuple):
    """One state to move: its sub-group index, what holds it (the optimizer-state key, or ``(master, host)`` for
    ``hp_param``), its kind (a state name such as ``exp_avg``, or ``hp_param``), its size in bytes and dtype."""

    group: int
    target: Any
    kind: str
    nbytes: int
    dtype: torch.dtype


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(logging.DEBUG, msg)


def lazy_init() -> None:
    global copy_stream, offload_event, reload_event
    accelerator = get_accelerator()
    if copy_stream is None and accelerator.device_name() != "cpu":
        copy_stream = accelerator.Stream()
        offload_event = accelerator.Event()
        reload_event = accelerator.Event()


def _on_copy_stream():
    return get_accelerator().stream(copy_stream) if copy_stream is not None else contextlib.nullcontext()


def _hold_for_copy(tensor: torch.Tensor) -> None:
    """Keep ``tensor``'s device block allocated until the copy stream's queued work has read it."""
    if copy_stream is not None and tensor.device.type != "cpu":
        tensor.record_stream(copy_stream)


def _mark(event: Any) -> None:
    if copy_stream is not None:
        event.record(stream=copy_stream)


def _after_compute() -> None:
    """Order the copy stream after what the compute stream has queued (e.g. the optimizer step's writes)."""
    if copy_stream is not None:
        copy_stream.wait_stream(get_accelerator().current_stream())


def _host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    return get_accelerator().pin_memory(torch.empty_like(tensor, device="cpu"))


# ---- the moves -----------------------------------------------------------------------------------------------
def _state_keys(state: dict) -> list[str]:
    """Per-element tensor states (scalars such as ``step`` stay), resident or already moved out."""
    suffix = _make_offload_state_key("")
    keys = []
    for key, value in state.items():
        name = key[:-len(suffix)] if isinstance(key, str) and key.endswith(suffix) else key
        if isinstance(value, torch.Tensor) and value.dim() > 0 and name not in keys:
            keys.append(name)
    return keys


def offload_state(state: dict, key: str) -> None:
    """Copy ``state[key]`` to its host buffer and drop the device tensor (nothing to do if already out)."""
    if key not in state:
        return
    resident = state[key]
    host_key = _make_offload_state_key(key)
    if host_key not in state:
        state[host_key] = _host_buffer_like(resident)
    with _on_copy_stream():
        state[host_key].copy_(resident, non_blocking=True)
    _hold_for_copy(resident)
    del state[key]
    _mark(offload_event)


def reload_state(state: dict, key: str) -> None:
    """Bring ``state[key]`` back from its host buffer into a new device tensor."""
    host = state[_make_offload_state_key(key)]
    resident = torch.empty_like(host, device=device)
    # the allocator may hand out blocks the compute stream still reads: write only after that work
    _after_compute()
    with _on_copy_stream():
        resident.copy_(host, non_blocking=True)
    _hold_for_copy(resident)
    state[key] = resident
    _mark(reload_event)


def offload_master(master: torch.Tensor, host: torch.Tensor) -> None:
    """Move an fp32 master partition into ``host`` (the tensor object stays: the optimizer holds it)."""
    if master.data_ptr() == host.data_ptr():
        return
    with _on_copy_stream():
        host.copy_(master, non_blocking=True)
    _hold_for_copy(master)
    master.data = host
    _mark(offload_event)


def reload_master(master: torch.Tensor, host: torch.Tensor) -> None:
    if master.data_ptr() != host.data_ptr():
        return
    resident = torch.empty_like(host, device=device)
    _after_compute()
    with _on_copy_stream():
        resident.copy_(host, non_blocking=True)
    _hold_for_copy(resident)
    master.data = resident
    _mark(reload_event)


def _synchronize() -> None:
    if copy_stream is not None:
        copy_stream.synchronize()


def _ensure_master_buffers() -> None:
    if not hasattr(optimizer, "hp_params_pin_buffers"):
        optimizer.hp_params_pin_buffers = [_host_buffer_like(t) for t in optimizer.fp32_partitioned_groups_flat]


def offload_adam_states_sync() -> None:
    """Move every state and master partition to host memory now (waits for the copies)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        _ensure_master_buffers()
        _after_compute()
        for state in optimizer.state.values():
            for key in _state_keys(state):
                offload_state(state, key)
        for master, host in zip(optimizer.fp32_partitioned_groups_flat, optimizer.hp_params_pin_buffers, strict=True):
            offload_master(master, host)
        _synchronize()


def reload_adam_states_sync() -> None:
    """Bring every moved state and master partition back to the device now (waits for the copies)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        for state in optimizer.state.values():
            for key in _state_keys(state):
                if key not in state:
                    reload_state(state, key)
        for master, host in zip(optimizer.fp32_partitioned_groups_flat, optimizer.hp_params_pin_buffers, strict=True):
            reload_master(master, host)
        _synchronize()


def _profiling() -> bool:
    return nz3 is not None and nz3.is_profiling()


def sync_offload_states(event: Any = None) -> None:
    if _profiling():
        offload_adam_states_sync()
    elif copy_stream is not None:
        (event or offload_event).wait(copy_stream)


def sync_reload_states(event: Any = None) -> None:
    if _profiling():
        reload_adam_states_sync()
    elif copy_stream is not None:
        (event or reload_event).wait(copy_stream)


# ---- the graph operators ---------------------------------------------------------------------------------------
_op_task_registry: list[_Task] = []
_offload_ops_lib = None
# Executions outside profiling prove the ops survived compilation (a dropped op silently keeps states resident).
_offload_op_stats = {"launches": 0, "reloads": 0}
# Set when the backward planner runs (once per compile phase), cleared by the first opt_empty_cache.
_empty_cache_pending = False


def get_offload_op_stats() -> dict[str, int]:
    return dict(_offload_op_stats)


def reset_offload_op_stats() -> None:
    for key in _offload_op_stats:
        _offload_op_stats[key] = 0


def _register_op_task(task: _Task) -> int:
    _op_task_registry.append(task)
    return len(_op_task_registry) - 1


def _offload_opt_launch_impl(anchor: torch.Tensor, idx: int) -> None:
    _offload_op_stats["launches"] += 1
    task = _op_task_registry[idx]
    with torch.no_grad():
        _after_compute()
        if task.kind == HP_PARAM:
            offload_master(*task.target)
            return
        if task.target not in optimizer.state:
            raise RuntimeError(f"offload_adam_states: the optimizer has no state for task {task.group}_{task.kind}; "
                               "was the optimizer rebuilt after compile?")
        offload_state(optimizer.state[task.target], task.kind)


def _reload_opt_impl(anchor: torch.Tensor, idx: int) -> None:
    if _profiling():  # the profile must measure the floor, with the states out
        return
    _offload_op_stats["reloads"] += 1
    task = _op_task_registry[idx]
    with torch.no_grad():
        if task.kind == HP_PARAM:
            reload_master(*task.target)
        elif task.kind not in optimizer.state[task.target]:
            reload_state(optimizer.state[task.target], task.kind)


def _opt_empty_cache_impl(anchor: torch.Tensor) -> None:
    # returning freed blocks to the driver once per compile phase is enough; per step it costs time
    global _empty_cache_pending
    if _empty_cache_pending:
        _empty_cache_pending = False
        get_accelerator().empty_cache()


def _reload_copy_stream_sync_impl(anchor: torch.Tensor) -> None:
    _synchronize()


_OFFLOAD_OP_SPECS = [
    ("offload_opt_launch", "offload_opt_launch(Tensor anchor, int idx) -> ()", _offload_opt_launch_impl),
    ("reload_opt", "reload_opt(Tensor anchor, int idx) -> ()", _reload_opt_impl),
    ("opt_empty_cache", "opt_empty_cache(Tensor anchor) -> ()", _opt_empty_cache_impl),
    ("reload_copy_stream_sync", "reload_copy_stream_sync(Tensor anchor) -> ()", _reload_copy_stream_sync_impl),
]


def _noop(*args: Any) -> None:
    return None


def register_offload_ops() -> None:
    """Define the ``torch.ops.dc`` operators above (once per process)."""
    global _offload_ops_lib
    if _offload_ops_lib is not None:
        return
    # FRAGMENT: the namespace's DEF library belongs to the ZeRO operators (custom_ops.dc_ops); either may load first
    lib = torch.library.Library("dc", "FRAGMENT")  # noqa: TOR901 - kept for the life of the process
    for name, schema, impl in _OFFLOAD_OP_SPECS:
        lib.define(schema)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        lib.impl(name, _noop, "Meta")
    for name, _, _ in _OFFLOAD_OP_SPECS:
        overload = getattr(torch.ops.dc, name).default
        torch.fx.node._side_effectful_functions.add(overload)
        if _register_effectful_op is not None:
            _register_effectful_op(overload, _EffectType.ORDERED)
    _offload_ops_lib = lib  # the operators disappear if the library object is collected


# ---- planning ----------------------------------------------------------------------------------------------------
offload_tasks: list[_Task] = []  # built at the first forward graph, front first
offload_tasks_scheduled: list[_Task] = []  # those chosen to leave the device
offload_tasks_inserted = 0  # how many of offload_tasks_scheduled already have launch nodes
reload_tasks_remaining: list[_Task] = []  # not yet brought back in the backward graphs planned so far
total_reload_mem = 0  # bytes brought back so far in this backward


def _budget() -> float:
    override = os.environ.get(BUDGET_ENV)
    if override is not None:  # pretend the device has this many GB (forces or suppresses offloading)
        try:
            return float(override) * 1e9
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={override!r}: expected a number of GB") from None
    return get_accelerator().total_memory() * (1 - MARGIN)


def _running_peaks(graph: Graph, mem: list, reverse: bool) -> dict[str, int]:
    """Node name -> highest profiled peak up to that node (from the end when ``reverse``); unprofiled nodes
    carry the running value."""
    profiled = {name: peak for name, _alloc, _delta, peak in mem}
    running, peaks = 0, {}
    for node in (reversed(graph.nodes) if reverse else graph.nodes):
        running = max(running, profiled.get(node.name, 0))
        peaks[node.name] = running
    return peaks


def _anchor(graph: Graph):
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            return node
    raise ValueError("offload_adam_states: the graph has no tensor input to anchor its operators on")


def _build_tasks() -> list[_Task]:
    tasks = []
    entries = list(optimizer.state.items())
    masters = zip(optimizer.fp32_partitioned_groups_flat, optimizer.hp_params_pin_buffers, strict=True)
    for i, (master, host) in enumerate(masters):
        # ZeRO-3 keys each sub-group's state by its master; otherwise the entries are in sub-group order
        if master in optimizer.state:
            key = master
        elif i < len(entries):
            key = entries[i][0]
        else:
            key = None  # no state yet (before the first step): only the master moves
        if key is not None:
            state = optimizer.state[key]
            for kind in _state_keys(state):
                buf = state[_make_offload_state_key(kind)]
                tasks.append(_Task(i, key, kind, buf.numel() * buf.element_size(), buf.dtype))
        tasks.append(_Task(i, (master, host), HP_PARAM, master.numel() * master.element_size(), master.dtype))
    return tasks


def _plan_forward(graph: Graph, graph_id: int, graph_order: list, peaks: dict[str, int], budget: float) -> None:
    global offload_tasks_inserted, total_reload_mem
    if graph_id == graph_order[0][0]:  # a new compile phase: start over (no double scheduling)
        offload_tasks.clear()
        offload_tasks_scheduled.clear()
        _op_task_registry.clear()
        offload_tasks_inserted = 0
        total_reload_mem = 0
        offload_adam_states_sync()  # allocates the host buffers the tasks are sized from
        reload_adam_states_sync()
        offload_tasks.extend(_build_tasks())

    for node in graph.nodes:
        if node.op == "placeholder" or node.name.startswith("offload_opt_"):
            continue
        # the peaks were profiled with every state out, so the states still resident add to them
        resident = sum(t.nbytes for t in offload_tasks)
        while offload_tasks and budget - peaks.get(node.name, 0) - resident < 0:
            task = offload_tasks.pop(0)
            offload_tasks_scheduled.append(task)
            resident -= task.nbytes
            _log(f"offload_adam_states: graph {graph_id} moves {task.group}_{task.kind} ({task.nbytes} bytes) out")

    anchor = _anchor(graph)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):  # each forward graph launches only its own share
        for task in offload_tasks_scheduled[offload_tasks_inserted:]:
            graph.create_node("call_function", torch.ops.dc.offload_opt_launch.default,
                              (anchor, _register_op_task(task)), {}, name=f"offload_opt_{task.group}_{task.kind}")
    offload_tasks_inserted = len(offload_tasks_scheduled)


def _insert_reload(graph: Graph, anchor: Any, task: _Task, where: Any, after: bool):
    ctx = graph.inserting_after(where) if after else graph.inserting_before(where)
    with ctx:
        return graph.create_node("call_function", torch.ops.dc.reload_opt.default, (anchor, _register_op_task(task)),
                                 {}, name=f"reload_opt_{task.group}_{task.kind}")


def _plan_backward(graph: Graph, graph_id: int, graph_order: list, peaks: dict[str, int], budget: float) -> None:
    global _empty_cache_pending, reload_tasks_remaining, total_reload_mem
    backward_ids = [gid for gid, needs_backward in graph_order if needs_backward]
    anchor = _anchor(graph)
    if graph_id == backward_ids[-1]:  # backward runs the graphs in reverse: this one runs first
        _empty_cache_pending = True
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            graph.create_node("call_function", torch.ops.dc.opt_empty_cache.default, (anchor, ), {},
                              name="empty_cache")
        reload_tasks_remaining = copy.copy(offload_tasks_scheduled)
        total_reload_mem = 0

    for node in list(graph.nodes):
        if node.op in ("placeholder", "output") or node.name not in peaks:
            continue
        where = node
        # bring states back as early as the budget allows, chained after this node in order
        while reload_tasks_remaining and \
                budget > peaks[node.name] + total_reload_mem + reload_tasks_remaining[0].nbytes:
            task = reload_tasks_remaining.pop(0)
            where = _insert_reload(graph, anchor, task, where, after=True)
            total_reload_mem += task.nbytes

    if graph_id == backward_ids[0]:  # the last backward graph: everything must be back before the step
        output = next(n for n in graph.nodes if n.op == "output")
        for task in reload_tasks_remaining:
            _insert_reload(graph, anchor, task, output, after=False)
        reload_tasks_remaining = []
        with graph.inserting_before(output):
            graph.create_node("call_function", torch.ops.dc.reload_copy_stream_sync.default, (anchor, ), {},
                              name="reload_copy_stream_sync")


def offload_opt_states_inc(graph: Graph, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                           mem_budget: float, param_manager: Any, bwd: bool) -> Graph:
    """Insert this graph's offload (forward) or reload (backward) operators, planned against the profile."""
    register_offload_ops()
    profile = profiling_results[graph_id]
    budget = _budget()
    peaks = _running_peaks(graph, profile.bwd_mem if bwd else profile.fwd_mem, reverse=bwd)
    if bwd:
        _plan_backward(graph, graph_id, graph_order, peaks, budget)
    else:
        _plan_forward(graph, graph_id, graph_order, peaks, budget)
    return graph


def move_opt_states(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                    create_inputs_fn: Any, mem_budget: float, param_manager: Any, bwd: bool) -> GraphModule:
    gm.graph = offload_opt_states_inc(gm.graph, graph_id, graph_order, profiling_results, mem_budget, param_manager,
                                      bwd)
    return gm


def move_opt_states_sync(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                         create_inputs_fn: Any, mem_budget: float, param_manager: Any, bwd: bool) -> GraphModule:
    """Everything out at the head of the first forward graph, back at the end of backward (no profile needed:
    a zero budget schedules every state)."""
    register_offload_ops()
    peaks = _running_peaks(gm.graph, [], reverse=bwd)
    if bwd:
        _plan_backward(gm.graph, graph_id, graph_order, peaks, 0.0)
    else:
        _plan_forward(gm.graph, graph_id, graph_order, peaks, 0.0)
    return gm


def offload_adam_states_for_init(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]],
                                 profiling_results: Any, create_inputs_fn: Any, mem_budget: float, param_manager: Any,
                                 bwd: bool) -> None:
    """Move every state out before the first forward graph is profiled; returns None (the graph is unchanged)."""
    if not bwd and graph_id == graph_order[0][0]:
        offload_adam_states_sync()


def init_offload_opt_states(adam_optimizer: Any, handle: Any) -> None:
    """Bind the pass to the ZeRO-3 optimizer whose states it moves and to the DeepCompile handle."""
    global optimizer, device, nz3
    lazy_init()
    register_offload_ops()
    optimizer = adam_optimizer
    device = torch.device(get_accelerator().current_device_name())
    nz3 = handle
