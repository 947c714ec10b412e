"""``prefetch``: start ZeRO-3 all-gathers early, fused into groups, while the profile says memory allows.

The pass walks the graph backwards from the output. Each ``allgather_param`` met joins an open group; the group is
closed when adding the next one would not pay (the fused gather would take longer than ``1 / FUSE_FACTOR`` times the
longer of the two alone, per the measured all-gather cost model) or would exceed ``MAX_FUSE_SIZE`` bytes. Closed
groups keep moving earlier with the walk: a group is issued (``dc.prefetch_params_fused``) at the point where
moving it further would make the profiled peak of the node before plus the bytes of every group in flight exceed
the memory limit (``total * (1 - MARGIN)``, minimum over ranks) or ``MAX_BUFFERED_SIZE``; or just after the node
that produces one of its inputs or releases one of its parameters; or, at the latest, right after the graph's
inputs. The original ``allgather_param`` nodes stay where they are: they find the prefetched value ready.

Nothing changes when the profile is incomplete (a node failed while profiling on some rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
from torch.fx import Graph, GraphModule, Node

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from ..list_schedule import dc_op
from ..profilers.comm_profile import create_predictor
from ..profilers.graph_profile import current_device, is_profile_incomplete
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "prefetch"
# Moves the all-gathers zero3_compile inserted.
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

FUSE_FACTOR = 0.8  # fuse while fused_time * FUSE_FACTOR < max(time of each part alone)
MARGIN = 0.1  # share of device memory never planned for
MAX_FUSE_SIZE = 1e9  # bytes in one fused all-gather
MAX_BUFFERED_SIZE = 4e9  # bytes of prefetched parameters in flight at once

Step = Union[Node, list[Node]]  # a node of the graph, or a group of all-gathers to prefetch there


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message)


def get_ds_id(node: Node) -> int:
    if node.target != dc_op("allgather_param"):
        raise ValueError(f"get_ds_id: {node.name} is not a dc.allgather_param node (target {node.target})")
    return node.args[2]


class _Planner:
    """The backward walk of ``plan_prefetch``: groups of all-gathers and where each is issued."""

    def __init__(self, sizes: dict[str, int], predictor: Callable[[float], float], max_mem: float):
        self.sizes, self.predictor, self.max_mem = sizes, predictor, max_mem
        self.open: list[Node] = []  # still fusing
        self.closed: list[list[Node]] = []  # oldest first (the latest in forward order)
        self.buffered = 0
        self.out_rev: list[Step] = []

    def size(self, ags: list[Node]) -> int:
        return sum(self.sizes.get(ag.name, 0) for ag in ags)

    def close_open(self) -> None:
        if self.open:
            self.closed.append(self.open)
            self.open = []

    def issue(self, group: list[Node]) -> None:
        # appended before the current node in reverse: in forward order the prefetch runs right after it;
        # the group was collected backwards, so it is reversed to gather first what is needed first
        self.closed.remove(group)
        self.buffered -= self.size(group)
        self.out_rev.append(group[::-1])

    def issue_blocked_by(self, node: Node, blockers: dict[Node, set[Node]]) -> None:
        blocked = blockers.get(node, set())
        if blocked & set(self.open):
            self.close_open()
        for group in [g for g in self.closed if blocked & set(g)]:
            self.issue(group)

    def make_room(self, peak_before: float) -> None:
        while peak_before + self.buffered > self.max_mem or self.buffered > MAX_BUFFERED_SIZE:
            if self.closed:
                self.issue(self.closed[0])
            elif self.open:
                self.close_open()
            else:
                break

    def add(self, ag: Node) -> None:
        current, new = self.size(self.open), self.sizes.get(ag.name, 0)
        fused = self.predictor(current + new)
        worth_it = fused * FUSE_FACTOR < max(self.predictor(current), self.predictor(new))
        if self.open and not (worth_it and current + new < MAX_FUSE_SIZE):
            self.close_open()
        self.open.append(ag)
        self.buffered += new

    def flush(self) -> None:
        self.close_open()
        for group in list(self.closed):
            self.issue(group)


# Ops on a parameter (by its ds_id, args[2]) that a prefetch of the same parameter may not move above.
_SAME_PARAM_OPS = ("release_param", "reload_parameter", "offload_parameter")


def _blockers(nodes: list[Node]) -> dict[Node, set[Node]]:
    """node -> all-gathers whose prefetch may not move above it: the producer of the gathered input (unless it is
    a graph input) and every release / reload / offload of the same parameter. Those after the all-gather are
    met before it in the backward walk, while it is not yet buffered, so they cost nothing."""
    allgather = dc_op("allgather_param")
    same_param_ops = {op for op in map(dc_op, _SAME_PARAM_OPS) if op is not None}
    ags = [n for n in nodes if n.target == allgather]
    out: dict[Node, set[Node]] = {}
    for ag in ags:
        if isinstance(ag.args[0], Node) and ag.args[0].op != "placeholder":
            out.setdefault(ag.args[0], set()).add(ag)
    for n in nodes:
        if n.target in same_param_ops:
            out.setdefault(n, set()).update(ag for ag in ags if ag.args[2] == n.args[2])
    return out


def plan_prefetch(nodes: list[Node], peaks: dict[str, float], sizes: dict[str, int],
                  predictor: Callable[[float], float], max_mem: float) -> list[Step]:
    """The new forward order: every node of ``nodes`` plus groups of all-gathers to prefetch (see module doc).

    ``peaks``: profiled peak bytes per node name; ``sizes``: gathered bytes per all-gather node name.
    """
    allgather = dc_op("allgather_param")
    planner = _Planner(sizes, predictor, max_mem)
    blockers = _blockers(nodes)
    rev = list(reversed(nodes))
    for i, node in enumerate(rev):
        before = rev[i + 1] if i + 1 < len(rev) else None
        if node.op != "placeholder":
            planner.issue_blocked_by(node, blockers)
            if before is not None:
                planner.make_room(peaks.get(before.name, 0))
            if node.target == allgather:
                planner.add(node)
        planner.out_rev.append(node)
        if node.op != "placeholder" and (before is None or before.op == "placeholder"):
            planner.flush()  # right after the inputs, before the first computation
    if planner.buffered != 0:
        raise AssertionError(f"prefetch plan left {planner.buffered} bytes of all-gathers unissued")
    return list(reversed(planner.out_rev))


def _build_graph(order: list[Step], graph_id: int, like: Graph) -> Graph:
    new_graph = Graph()
    new_graph.set_codegen(like._codegen)
    env: dict[Node, Node] = {}
    prefetch_op = dc_op("prefetch_params_fused")
    for step in order:
        if isinstance(step, Node):
            env[step] = new_graph.node_copy(step, lambda n: env[n])
            continue
        params = [env[ag.args[0]] for ag in step]
        dtypes = [ag.kwargs.get("dtype", ag.args[3] if len(ag.args) > 3 else None) for ag in step]
        new_graph.call_function(prefetch_op, (graph_id, params, [get_ds_id(ag) for ag in step], dtypes))
    new_graph.lint()
    return new_graph


def _profile_tables(profile: Any, graph: Graph, bwd: bool) -> tuple[dict[str, float], dict[str, int]]:
    """Peak bytes per node (a node the profile missed takes its predecessor's) and gathered bytes per node."""
    mem = profile.bwd_mem if bwd else profile.fwd_mem
    recorded = {name: peak for name, _alloc, _delta, peak in mem}
    sizes = dict(profile.bwd_tensor_sizes if bwd else profile.fwd_tensor_sizes)
    peaks: dict[str, float] = {}
    last = 0
    for n in graph.nodes:
        last = recorded.get(n.name, last)
        peaks[n.name] = last
        sizes.setdefault(n.name, n.meta.get("tensor_size", 0))
    return peaks, sizes


def schedule_prefetch(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: dict,
                      create_inputs_fn: Any, mem_budget: float, param_manager: Any, bwd: bool) -> GraphModule:
    """Insert fused prefetches of ZeRO-3 parameters into ``gm`` (see the module docstring)."""
    profile = profiling_results[graph_id]
    profiled_graph = profile.bwd_graph if bwd else profile.fwd_graph
    mem_complete = profile.bwd_mem_complete if bwd else profile.fwd_mem_complete
    if is_profile_incomplete(profiled_graph) or not mem_complete:
        print_rank_0(f"schedule_prefetch graph_id={graph_id}: incomplete profiling data; skipping prefetch")
        return gm

    limit = torch.tensor([get_accelerator().total_memory() * (1 - MARGIN)], dtype=torch.float64,
                         device=current_device())
    if dist.is_initialized():
        dist.all_reduce(limit, op=dist.ReduceOp.MIN)
    max_mem = float(limit.item())
    peaks, sizes = _profile_tables(profile, gm.graph, bwd)
    order = plan_prefetch(list(gm.graph.nodes), peaks, sizes, create_predictor(), max_mem)
    n_groups = sum(1 for step in order if not isinstance(step, Node))
    print_rank_0(f"schedule_prefetch graph_id={graph_id} {'bwd' if bwd else 'fwd'}: {n_groups} prefetch groups, "
                 f"max_mem={max_mem:.0f}")
    gm.graph = _build_graph(order, graph_id, gm.graph)
    return gm
