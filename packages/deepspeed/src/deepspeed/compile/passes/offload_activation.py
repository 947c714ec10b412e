"""DeepCompile passes ``offload_activation_floor`` and ``offload_activation`` (``compile.offload_activation``): move
the activations the forward graph saves for backward to host memory, and bring each back before backward reads it.

Two halves, scheduled in this order:

- ``offload_activation_floor`` moves *every* eligible saved activation out (``dc.offload_tensor`` right after the
  tensor's last forward use, ``dc.wait_offload`` right after it; the backward graph then receives the host buffer)
  and, in backward, copies each back (``dc.reload_tensor`` early enough for the measured host-to-device bandwidth
  to hide the copy behind the profiled node times, as far as the memory budget allows; ``dc.wait_reload`` right
  before the first reader, which reads the reloaded tensor). The graph it returns is profiled: that profile is the
  *floor*, the peak with everything out. On its own it is a complete, runnable configuration.
- ``offload_activation`` reads the floor and keeps resident (undoes the move of) the largest activations while the
  headroom between the floor and the budget holds them; in backward it removes the copies back of those it kept.
  It returns None: nothing reads a profile of its result, and a replay at this memory pressure is what fails.

Eligible: a floating-point tensor of fixed shape on the accelerator, at least ``MIN_OFFLOAD_SIZE`` bytes, saved
once, not also returned to the caller, not a parameter (ZeRO manages those), not a view of another tensor (copying
it out frees nothing). Host tensors are never candidates, so on a CPU-only run the pass changes nothing.

The budget is the smallest device's memory less a measured allocator margin (agreed with MIN across ranks), and the
floor is the largest rank's (MAX): every rank must reach the same plan, since they run the same graph.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ..fx import get_output_node
from ..profilers.graph_profile import _get_mem_usage_out_of_torch
from ..util import get_deepcompile_handle, get_no_copy_ops
from .contract import PassContract

NAME = "offload_activation"
FLOOR_NAME = "offload_activation_floor"
# It moves only what the forward graph saves; it reads and rewrites nothing the other passes produce.
CONTRACT = PassContract()

# Share of device memory left to the allocator when its overhead cannot be read.
MARGIN = 0.1
# The reading is taken before the memory-heavy phase, so it is usually near zero: the floor is what actually
# covers peak-time fragmentation and profile error; a fat allocator may raise it up to the ceiling.
MIN_MEASURED_MARGIN = 0.1
MAX_MEASURED_MARGIN = 0.25
# Smaller tensors cost more in copy launches than the memory they return.
MIN_OFFLOAD_SIZE = 5 * 1024 * 1024
DEFAULT_H2D_BYTES_PER_SEC = 10e9

BUDGET_ENV = "DS_DC_OFFLOAD_ACT_BUDGET_GB"
MARGIN_ENV = "DS_DC_OFFLOAD_ACT_MARGIN"
MIN_SIZE_ENV = "DS_DC_OFFLOAD_ACT_MIN_SIZE_MB"

_ACTIVATION_OFFLOAD_OPS = ("offload_tensor", "wait_offload", "reload_tensor", "wait_reload")
_activation_ops_lib = None

# graph id -> {saved activation's node name: (value id, bytes)} of what the forward half left on the host; the
# backward graph receives those tensors as placeholders of the same names.
_offload_plans: dict[int, OrderedDict[str, tuple[int, int]]] = {}
# a value id names one host buffer in the runtime; never reused, so a buffer never changes shape
_next_value_id = 0
_h2d_bytes_per_sec: float | None = None
# nodes built (offload_nodes/reload_nodes, net of those undone) and what the last plan left on the host
_stats = {"offload_nodes": 0, "reload_nodes": 0, "planned_offloads": 0}


def get_offload_activation_stats() -> dict[str, int]:
    return dict(_stats)


def reset_offload_activation_stats() -> None:
    for key in _stats:
        _stats[key] = 0


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(logging.INFO, msg)


def _meta_like(tensor: torch.Tensor, graph_id: int, value_id: int) -> torch.Tensor:
    return torch.empty_like(tensor)


def register_activation_offload_ops() -> None:
    """Make sure the ``dc`` copy operators exist (the DeepCompile runtime defines them) and can be traced: each
    gets a Meta kernel if it has none."""
    global _activation_ops_lib
    if _activation_ops_lib is not None:
        return
    get_deepcompile_handle()
    lib = torch.library.Library("dc", "FRAGMENT")  # noqa: TOR901 - kept for the life of the process
    for name in _ACTIVATION_OFFLOAD_OPS:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{name}", "Meta"):
            lib.impl(name, _meta_like, "Meta")
    _activation_ops_lib = lib


def _new_value_id() -> int:
    global _next_value_id
    _next_value_id += 1
    return _next_value_id


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number") from None


# ---- memory figures -----------------------------------------------------------------------------------------------
def _measured_margin(accelerator: Any) -> float:
    """Share of the device the allocator holds without using (reserved - allocated), clamped to
    [MIN_MEASURED_MARGIN, MAX_MEASURED_MARGIN]; ``DS_DC_OFFLOAD_ACT_MARGIN`` overrides it."""
    override = _env_float(MARGIN_ENV)
    if override is not None:
        return override
    total = accelerator.total_memory()
    if not total:
        return MARGIN
    slack = max(0, accelerator.memory_reserved() - accelerator.memory_allocated()) / total
    return min(max(slack, MIN_MEASURED_MARGIN), MAX_MEASURED_MARGIN)


def _reduce_scalar(value: float, op: Any) -> float:
    accelerator = get_accelerator()
    where = accelerator.current_device()
    device = torch.device(where) if isinstance(where, str) else torch.device(accelerator.current_device_name())
    tensor = torch.tensor([float(value)], device=device)
    dist.all_reduce(tensor, op)
    return tensor[0].item()


def _memory_budget() -> float:
    """Bytes the plan may use: ``DS_DC_OFFLOAD_ACT_BUDGET_GB`` if set, else the smallest rank's device memory
    less its margin."""
    override = _env_float(BUDGET_ENV)
    if override is not None:
        return override * 1e9
    accelerator = get_accelerator()
    budget = accelerator.total_memory() * (1 - _measured_margin(accelerator))
    return _reduce_scalar(budget, dist.ReduceOp.MIN) if dist.is_initialized() else budget


def _agree_on_floor_peak(floor_peak: float) -> float:
    """The highest floor any rank measured: the busiest rank decides what may come back."""
    if not dist.is_initialized():
        return float(floor_peak)
    return _reduce_scalar(floor_peak, dist.ReduceOp.MAX)


def _min_offload_size() -> int:
    override = _env_float(MIN_SIZE_ENV)
    return MIN_OFFLOAD_SIZE if override is None else int(override * 1024 * 1024)


def _h2d_bandwidth() -> float:
    """Host-to-device copy speed in bytes/s, measured once (platforms differ by over 10x); it decides how far
    ahead of its reader a copy back starts."""
    global _h2d_bytes_per_sec
    if _h2d_bytes_per_sec is not None:
        return _h2d_bytes_per_sec
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    accelerator = get_accelerator()
    _h2d_bytes_per_sec = DEFAULT_H2D_BYTES_PER_SEC
    try:
        with unset_fake_temporarily():
            nbytes, repeats = 32 * 1024 * 1024, 5
            host = accelerator.pin_memory(torch.empty(nbytes, dtype=torch.uint8))
            dev = torch.empty(nbytes, dtype=torch.uint8, device=accelerator.current_device_name())
            dev.copy_(host, non_blocking=True)  # the first copy pays for set-up
            accelerator.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                dev.copy_(host, non_blocking=True)
            accelerator.synchronize()
            elapsed = time.perf_counter() - start
        if elapsed > 0:
            _h2d_bytes_per_sec = nbytes * repeats / elapsed
    except Exception as exc:  # no measurement: keep the default rather than fail the compile
        _log(f"offload_activation: host-to-device bandwidth not measured ({exc}); assuming "
             f"{DEFAULT_H2D_BYTES_PER_SEC / 1e9:.0f} GB/s")
    return _h2d_bytes_per_sec


# ---- forward: what may move, and moving it ---------------------------------------------------------------------
def _device_bytes(node: Node) -> int | None:
    """Bytes of the device tensor ``node`` produces; None for non-tensors, host tensors, symbolic shapes."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type == "cpu":
        return None
    if not all(isinstance(dim, int) for dim in val.shape):
        return None
    return val.numel() * val.element_size()


def _eligible_activations(graph: Graph, graph_id: int, num_fwd_outputs: int | None,
                          param_manager: Any) -> list[tuple[Node, int]]:
    """The saved activations this pass may move, largest first."""
    outputs = get_output_node(graph).args[0]
    if num_fwd_outputs is None or not isinstance(outputs, (list, tuple)):
        _log(f"offload_activation: graph {graph_id} has no forward/saved split; nothing moved")
        return []
    returned = {n for n in outputs[:num_fwd_outputs] if isinstance(n, Node)}
    saved = [n for n in outputs[num_fwd_outputs:] if isinstance(n, Node)]
    params = set(param_manager[graph_id].param_names) if param_manager and graph_id in param_manager else set()
    aliasing = get_no_copy_ops()
    min_size = _min_offload_size()
    candidates = []
    for node in dict.fromkeys(saved):
        val = node.meta.get("val")
        if saved.count(node) > 1 or node in returned or node.name in params or node.target in aliasing:
            continue
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():  # indices, masks, RNG state
            continue
        size = _device_bytes(node)
        if size is not None and size >= min_size:
            candidates.append((node, size))
    candidates.sort(key=lambda c: c[1], reverse=True)
    return candidates


def _after_last_use(graph: Graph, node: Node) -> Node:
    """The node to insert a copy before: the first one after ``node``'s last reader (the output aside), past
    the placeholders."""
    nodes = list(graph.nodes)
    last = nodes.index(node)
    for i, other in enumerate(nodes):
        if other.op != "output" and node in other.all_input_nodes:
            last = i
    i = last + 1
    while nodes[i].op == "placeholder":
        i += 1
    return nodes[i]


def _copy_meta(src: Node, dst: Node) -> None:
    for key in ("val", "tensor_meta"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _offload_everything_fwd(gm: GraphModule, graph_id: int, profiling_results: Any,
                            param_manager: Any) -> GraphModule | None:
    _offload_plans[graph_id] = OrderedDict()  # a new compile phase plans from the original graph again
    selected = _eligible_activations(gm.graph, graph_id, profiling_results[graph_id].num_fwd_outputs, param_manager)
    if not selected:
        return None
    graph = gm.graph
    output = get_output_node(graph)
    for node, size in selected:
        value_id = _new_value_id()
        with graph.inserting_before(_after_last_use(graph, node)):
            copy = graph.create_node("call_function", torch.ops.dc.offload_tensor.default, (node, graph_id, value_id),
                                     {}, name=f"offload_{node.name}")
        # waiting at once ends the copy before anything else runs, so the compiler may reuse the device buffer
        # (a copy running on would need the buffer kept alive for the whole forward)
        with graph.inserting_after(copy):
            wait = graph.create_node("call_function", torch.ops.dc.wait_offload.default, (copy, graph_id, value_id),
                                     {}, name=f"wait_offload_{node.name}")
        _copy_meta(node, copy)
        _copy_meta(node, wait)
        output.replace_input_with(node, wait)
        _offload_plans[graph_id][node.name] = (value_id, size)
        _stats["offload_nodes"] += 1
    graph.lint()
    gm.recompile()
    _log(f"offload_activation: graph {graph_id} floor moves {len(selected)} activations "
         f"({sum(s for _, s in selected) / 1e9:.2f} GB) out")
    return gm  # profiled next: that profile is the floor


def _bring_back(graph: Graph, name: str) -> bool:
    """Undo one activation's move (the saved value is the device tensor again)."""
    nodes = {n.name: n for n in graph.nodes}
    original, copy, wait = nodes.get(name), nodes.get(f"offload_{name}"), nodes.get(f"wait_offload_{name}")
    if original is None or copy is None or wait is None:
        return False
    wait.replace_all_uses_with(original)
    graph.erase_node(wait)
    graph.erase_node(copy)
    return True


def _plan_against_floor_fwd(gm: GraphModule, graph_id: int, profiling_results: Any) -> None:
    plan = _offload_plans.get(graph_id)
    if not plan:
        return None
    profile = profiling_results[graph_id]
    if not profile.fwd_mem:  # even the floor could not be profiled: everything stays on the host
        _log(f"offload_activation: graph {graph_id} has no floor profile; all {len(plan)} activations stay out")
        return None
    # what the steps run so far actually reached beats the profile (which cannot see work outside the graph)
    observed = _agree_on_floor_peak(get_accelerator().max_memory_allocated() + _get_mem_usage_out_of_torch())
    floor = observed if observed > 0 else _agree_on_floor_peak(max(peak for *_, peak in profile.fwd_mem))
    headroom = _memory_budget() - floor
    kept = 0
    for name, (_value_id, size) in sorted(plan.items(), key=lambda item: item[1][1], reverse=True):
        if size <= headroom and _bring_back(gm.graph, name):
            del plan[name]
            headroom -= size
            kept += size
            _stats["offload_nodes"] -= 1
    _stats["planned_offloads"] = len(plan)
    _log(f"offload_activation: graph {graph_id} floor={floor:.0f} keeps {kept} bytes resident, "
         f"{len(plan)} activations ({sum(s for _, s in plan.values())} bytes) on the host")
    gm.graph.lint()
    gm.recompile()
    return None


# ---- backward: copies back --------------------------------------------------------------------------------------
def _reload_start(nodes: list[Node], first_use: int, size: int, in_flight: int, profile: Any, budget: float,
                  bandwidth: float) -> Node:
    """The node a copy back starts before: early enough that the profiled node times cover the copy, no earlier
    than the memory budget allows, never above the placeholders; just in time without a backward profile."""
    start = nodes[first_use]
    if not profile.bwd_mem:
        return start
    peaks = {name: peak for name, _alloc, _delta, peak in profile.bwd_mem}
    times = {name: ms for name, ms, _ in profile.bwd_time}
    needed_ms, covered_ms = size / bandwidth * 1000, 0.0
    for candidate in reversed(nodes[:first_use]):
        if candidate.op == "placeholder" or peaks.get(candidate.name, 0) + in_flight + size > budget:
            break
        covered_ms += times.get(candidate.name, 0.0)
        start = candidate
        if covered_ms >= needed_ms:
            break
    return start


def _reload_activation_bwd(gm: GraphModule, graph_id: int, profiling_results: Any) -> None:
    plan = _offload_plans.get(graph_id)
    if not plan:
        return None
    graph = gm.graph
    profile = profiling_results[graph_id]
    budget, bandwidth = _memory_budget(), _h2d_bandwidth()
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    targets = []
    for name, (value_id, size) in plan.items():
        node = placeholders.get(name)
        readers = [u for u in node.users if u.op != "output"] if node is not None else []
        if readers:
            targets.append((min(index[u] for u in readers), node, value_id, size))
    targets.sort(key=lambda t: t[0])  # the copy stream drains in order of first use
    in_flight = 0
    for first_use, node, value_id, size in targets:
        start = _reload_start(nodes, first_use, size, in_flight, profile, budget, bandwidth)
        with graph.inserting_before(start):
            reload = graph.create_node("call_function", torch.ops.dc.reload_tensor.default,
                                       (node, graph_id, value_id), {}, name=f"reload_{node.name}")
        with graph.inserting_before(nodes[first_use]):
            wait = graph.create_node("call_function", torch.ops.dc.wait_reload.default,
                                     (reload, graph_id, value_id), {}, name=f"wait_reload_{node.name}")
        _copy_meta(node, reload)
        _copy_meta(node, wait)
        node.replace_all_uses_with(wait, delete_user_cb=lambda user, r=reload: user is not r)
        in_flight += size
        _stats["reload_nodes"] += 1
    if not targets:
        return None
    graph.lint()
    gm.recompile()
    return None


def _drop_reloads_for_resident_bwd(gm: GraphModule, graph_id: int) -> None:
    """Remove the copies back of the activations the forward plan kept resident."""
    plan = _offload_plans.get(graph_id) or {}
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    dropped = 0
    for wait in [n for n in graph.nodes if n.name.startswith("wait_reload_")]:
        name = wait.name[len("wait_reload_"):]
        reload, placeholder = nodes.get(f"reload_{name}"), nodes.get(name)
        if name in plan or reload is None or placeholder is None:
            continue
        wait.replace_all_uses_with(placeholder)
        graph.erase_node(wait)
        graph.erase_node(reload)
        dropped += 1
    if dropped:
        _stats["reload_nodes"] -= dropped
        graph.lint()
        gm.recompile()


# ---- the schedule entries ---------------------------------------------------------------------------------------
def offload_activation_floor(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]],
                             profiling_results: Any, create_inputs_fn: Any, mem_budget: float, param_manager: Any,
                             bwd: bool) -> GraphModule | None:
    """First half: every eligible activation out in forward, each copied back in backward (runnable alone)."""
    register_activation_offload_ops()
    if bwd:
        return _reload_activation_bwd(gm, graph_id, profiling_results)
    return _offload_everything_fwd(gm, graph_id, profiling_results, param_manager)


def offload_activation(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                       create_inputs_fn: Any, mem_budget: float, param_manager: Any, bwd: bool) -> None:
    """Second half (after the floor was profiled): keep resident what the budget has room for."""
    register_activation_offload_ops()
    if bwd:
        _drop_reloads_for_resident_bwd(gm, graph_id)
        return None
    return _plan_against_floor_fwd(gm, graph_id, profiling_results)
