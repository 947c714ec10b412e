"""``selective_gather``: keep some ZeRO-3 parameters gathered for the whole step (``set_persistent``) when the
profile shows spare device memory, so their all-gathers stop costing time.

Runs once per compile, on the last backward graph (the backward of the first forward graph), when every graph's
profile is in. The headroom is what the profiled *transient* peak leaves of the usable memory
(``total * (1 - MEM_MARGIN)``, the minimum over ranks): a persistent parameter is alive during every op's
temporary allocations too, so the resident level alone would overstate the room. Candidates are taken in order of
all-gather time per byte (most time saved per byte first) while they fit; the first that does not fit ends the
selection. An incomplete profile changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.fx import GraphModule

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist

from ..list_schedule import dc_op
from ..profilers.graph_profile import current_device, is_profile_incomplete
from ..util import get_deepcompile_handle
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "selective_gather"
# Picks among the all-gathers zero3_compile inserted.
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}), phase="backward")

MEM_MARGIN = 0.1  # share of device memory never planned for (allocator fragmentation, workspaces)


def print_rank_0(message: str) -> None:
    log_dist(message, ranks=[0])


def _compute_persistence_budget(all_graph_mem_records: list[list[tuple[str, int, int, int]]], total_mem: int,
                                mem_margin: float) -> dict[str, int]:
    """Bytes available for new persistent parameters, from memory records ``(name, alloc, delta, peak)``.

    Returns ``usable_mem``, ``peak_resident_alloc`` (largest alloc), ``transient_peak`` (largest peak),
    ``available_mem`` (usable minus transient peak, at least 0) and ``profiled_list_count`` (non-empty lists).
    """
    usable = int(total_mem * (1 - mem_margin))
    records = [r for rec_list in all_graph_mem_records if rec_list for r in rec_list]
    resident = max((r[1] for r in records), default=0)
    transient = max((r[3] for r in records), default=0)
    return {
        "usable_mem": usable,
        "peak_resident_alloc": resident,
        "transient_peak": transient,
        "available_mem": max(0, usable - transient) if records else 0,
        "profiled_list_count": sum(1 for rec_list in all_graph_mem_records if rec_list),
    }


def _profile_result_incomplete(prof: Any) -> bool:
    return (is_profile_incomplete(prof.fwd_graph) or is_profile_incomplete(prof.bwd_graph)
            or not prof.fwd_mem_complete or (prof.needs_backward and not prof.bwd_mem_complete))


def _last_backward_graph_id(graph_order: list[tuple[int, bool]]) -> int | None:
    # Backward runs the graphs in reverse, so the first forward graph needing backward is the last backward.
    return next((g_id for g_id, needs_bwd in graph_order if needs_bwd), None)


def _param_sizes_and_times(param_manager: dict, profiling_results: dict) -> tuple[dict[int, int], dict[int, float]]:
    """Gathered bytes and total profiled all-gather device time (ms) per ds_id."""
    sizes: dict[int, int] = {}
    times: dict[int, float] = defaultdict(float)
    allgather = dc_op("allgather_param")
    for graph_id, pm in param_manager.items():
        for name, ds_param in pm.params.items():
            sizes[pm.ds_ids[name]] = ds_param.numel * ds_param.dtype.itemsize
        profile = profiling_results[graph_id]
        for graph in (profile.fwd_graph, profile.bwd_graph):
            for n in (graph.nodes if graph is not None else ()):
                if allgather is None or n.target != allgather:
                    continue
                ds_id = n.args[2]
                if n.meta.get("tensor_size", 0) > 0:  # the gathered dtype may differ from the partition's
                    sizes[ds_id] = n.meta["tensor_size"]
                times[ds_id] += n.meta.get("device_time", 0.0)
    return sizes, times


def _min_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=current_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def selective_gather(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: dict,
                     create_inputs_fn: Any, mem_budget: float, param_manager: dict, bwd: bool) -> GraphModule:
    """Mark parameters persistent within the profiled headroom (see the module docstring); the graph is unchanged."""
    if not bwd or graph_id != _last_backward_graph_id(graph_order):
        return gm
    incomplete = [g for g, prof in profiling_results.items() if _profile_result_incomplete(prof)]
    if incomplete:
        print_rank_0(f"selective_gather: incomplete profiling data for graph_ids={incomplete}; "
                     "skipping persistence update")
        return gm

    records = [rec for prof in profiling_results.values() for rec in (prof.fwd_mem, prof.bwd_mem)]
    already = {pm.ds_ids[name] for pm in param_manager.values() for name, p in pm.params.items()
               if p.param.ds_persist}
    sizes, times = _param_sizes_and_times(param_manager, profiling_results)
    candidates = sorted((d for d in sizes if d not in already),
                        key=lambda d: times[d] / sizes[d] if sizes[d] > 0 else 0.0, reverse=True)

    accelerator = get_accelerator()
    total_mem, current_available = _min_over_ranks([accelerator.total_memory(), accelerator.available_memory()])
    budget = _compute_persistence_budget(records, int(total_mem), MEM_MARGIN)
    print_rank_0(f"selective_gather graph_id={graph_id} {budget} current_available_mem={int(current_available)} "
                 f"persistent={len(already)} candidates={len(candidates)} "
                 f"candidate_bytes={sum(sizes[d] for d in candidates)}")
    if budget["profiled_list_count"] == 0 or not candidates or budget["available_mem"] == 0:
        print_rank_0("selective_gather: no memory profile, no candidate or no headroom; nothing made persistent")
        return gm

    handle = get_deepcompile_handle()
    used = 0
    for ds_id in candidates:
        if used + sizes[ds_id] > budget["available_mem"]:
            break
        used += sizes[ds_id]
        handle.set_persistent(ds_id)
        print_rank_0(f"selective_gather: ds_id={ds_id} persistent ({sizes[ds_id]} bytes, {used} in total)")
    if used == 0:
        print_rank_0(f"selective_gather: the first candidate ({sizes[candidates[0]]} bytes) exceeds the "
                     f"headroom of {budget['available_mem']} bytes")
    return gm
