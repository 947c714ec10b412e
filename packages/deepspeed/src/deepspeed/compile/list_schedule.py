"""Node order for a ZeRO-3 graph that frees gathered parameters early (``fast_free_schedule``).

zero3_compile puts an ``allgather_param`` / ``wait_allgather`` before the first use of each parameter and a
``release_param`` after its last. Any topological order is correct, but the order decides how many gathered
parameters are alive at once. The list scheduler here repeatedly picks the next all-gather to issue:

* among the pending all-gathers, only those with the fewest other all-gathers needed before the parameter's last
  use are candidates;
* a candidate whose last use needs no further all-gather (``free_acc_mem == 0``) is preferred: the schedule runs
  everything up to its release at once, choosing the one that gathers fewest parameters on the way, then the one
  gathering fewest bytes, then the one that frees soonest (least device time to its last use);
* otherwise only the all-gather (and what it needs) is scheduled, picking the one whose path to release needs the
  fewest gathered bytes.

Gradient reductions and graph outputs are scheduled as soon as every all-gather they depend on has been issued, so
their memory goes early too; whatever is left keeps the graph's original order. Node costs come from profile
metadata (``device_time``, ``tensor_size`` in ``node.meta``; missing values count as 0).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container, Iterable
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from deepspeed.utils import logger

from .util import get_last_uses, is_release_node


def dc_op(name: str):
    """``torch.ops.dc.<name>.default``, or None while the DeepCompile op library is not loaded."""
    packet = getattr(torch.ops.dc, name, None)
    return None if packet is None else packet.default


def make_graph_from_schedule(scheduled: Iterable[Node], like: Graph | None = None) -> Graph:
    """A new graph with copies of ``scheduled`` in that order (``like``: graph whose code generator to keep)."""
    new_graph = Graph()
    if like is not None:
        new_graph.set_codegen(like._codegen)
    env: dict[Node, Node] = {}
    for node in scheduled:
        env[node] = new_graph.node_copy(node, lambda n: env[n])
    return new_graph


class _Either:
    """Membership in either of two sets, without building their union."""

    def __init__(self, a: Container[Node], b: Container[Node]):
        self.a, self.b = a, b

    def __contains__(self, node: object) -> bool:
        return node in self.a or node in self.b


def get_node_requirements(target: Node, scheduled: Container[Node]) -> list[Node]:
    """``target`` and its not-yet-scheduled ancestors, each after its own inputs (iterative: graphs are deep)."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(target, False)]
    while stack:
        node, inputs_done = stack.pop()
        if inputs_done:
            order.append(node)
            continue
        if node in scheduled or node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((arg, False) for arg in reversed(node.all_input_nodes) if arg not in seen)
    return order


def _gather_ancestry(graph: Graph, bit: dict[Node, int]) -> dict[Node, int]:
    """node -> bit mask of the all-gathers among the node and its ancestors (one pass in graph order)."""
    masks: dict[Node, int] = {}
    for n in graph.nodes:
        mask = bit.get(n, 0)
        for arg in n.all_input_nodes:
            mask |= masks[arg]
        masks[n] = mask
    return masks


@dataclass
class AllgatherTask:
    """One candidate all-gather and what issuing it costs (ms of device time, bytes of gathered parameters)."""

    node: Node
    allgather_cost: float  # device time of the nodes that must run before the all-gather
    free_cost: float  # device time from the all-gather to the parameter's last use
    allgathered_mem: int  # bytes this all-gather brings
    allgather_acc_mem: int  # bytes gathered by all-gathers up to and including this one
    free_acc_mem: int  # bytes other all-gathers bring between this one and its last use
    last_use: Node
    n_scheduled_ags: int  # all-gathers issued if everything up to the release is scheduled
    schedule_until_ag: list[Node]
    schedule_until_free: list[Node]


def _free_path_allgather_key(task: AllgatherTask) -> tuple:
    return task.n_scheduled_ags, task.allgather_acc_mem, task.free_cost, task.node.name


def _fallback_allgather_key(task: AllgatherTask) -> tuple:
    return task.free_acc_mem, task.n_scheduled_ags, task.allgather_acc_mem, task.free_cost, task.node.name


class _FreeScheduler:
    """State of one ``fast_free_schedule`` run: the order so far and the all-gathers still to issue.

    Pending all-gathers on the way to a target are bit masks (bit ``i``: the ``i``-th all-gather of the graph),
    computed in one pass: per-target walks would make a graph with thousands of parameters quadratic in nodes.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.ag_op = dc_op("allgather_param")
        self.last_use = get_last_uses(graph)[0]
        self.order: list[Node] = [n for n in graph.nodes if n.op == "placeholder"]
        self.done: set[Node] = set(self.order)
        self.pending = [n for n in graph.nodes if self._is_ag(n)]
        self.bit = {ag: 1 << i for i, ag in enumerate(self.pending)}
        self.releases: dict[int, list[Node]] = defaultdict(list)
        for n in graph.nodes:
            if is_release_node(n):
                self.releases[n.args[2]].append(n)
        masks = _gather_ancestry(graph, self.bit)
        # all-gathers still pending on the way to each parameter's last use / each reduction / each output
        self.ags_before_free = {ag: masks[self._last_use(ag)] for ag in self.pending}
        self.waiting = {n: masks[n] for n in self._early_targets()}

    def _is_ag(self, n: Node) -> bool:
        return self.ag_op is not None and n.target == self.ag_op

    def _last_use(self, ag: Node) -> Node:
        return self.last_use.get(ag, ag)

    def _early_targets(self) -> list[Node]:
        reduce_op = dc_op("reduce_grad")
        reduces = [n for n in self.graph.nodes if reduce_op is not None and n.target == reduce_op]
        outs: list[Node] = []
        for output in (n for n in self.graph.nodes if n.op == "output"):
            map_arg(output.args, outs.append)
        return reduces + [n for n in dict.fromkeys(outs) if reduce_op is None or n.target != reduce_op]

    def take(self, nodes: Iterable[Node]) -> None:
        for n in nodes:
            if n not in self.done:
                self.order.append(n)
                self.done.add(n)
        for ag in [ag for ag in self.pending if ag in self.done]:
            self._retire(ag)

    def _retire(self, ag: Node) -> None:
        if ag not in self.ags_before_free:  # retired already by a nested take()
            return
        self.pending.remove(ag)
        del self.ags_before_free[ag]
        bit = self.bit[ag]
        for other, mask in self.ags_before_free.items():
            if mask & bit:
                self.ags_before_free[other] = mask & ~bit
        for target, mask in self.waiting.items():
            if mask & bit:
                self.waiting[target] = mask & ~bit
                if mask == bit:  # its last all-gather is out: run it now so its memory goes early
                    self.take(get_node_requirements(target, self.done))

    def task(self, ag: Node) -> AllgatherTask:
        until_ag = get_node_requirements(ag, self.done)
        last_use = self._last_use(ag)
        to_free = get_node_requirements(last_use, _Either(self.done, set(until_ag)))
        until_free = until_ag + to_free
        for release in self.releases[ag.args[2]]:
            listed = set(until_free)
            until_free += get_node_requirements(release, _Either(self.done, listed))
        return AllgatherTask(node=ag, allgather_cost=_meta_sum(until_ag, "device_time"),
                             free_cost=_meta_sum(to_free, "device_time"), allgathered_mem=ag.meta.get("tensor_size", 0),
                             allgather_acc_mem=_meta_sum(filter(self._is_ag, until_ag), "tensor_size"),
                             free_acc_mem=_meta_sum(filter(self._is_ag, to_free), "tensor_size"),
                             last_use=last_use, n_scheduled_ags=sum(map(self._is_ag, until_free)),
                             schedule_until_ag=until_ag, schedule_until_free=until_free)

    def candidates(self) -> list[AllgatherTask]:
        """Tasks for the pending all-gathers needing the fewest other all-gathers before their release."""
        counts = {ag: self.ags_before_free[ag].bit_count() for ag in self.pending}
        fewest = min(counts.values())
        return [self.task(ag) for ag in self.pending if counts[ag] == fewest]


def _meta_sum(nodes: Iterable[Node], key: str) -> float:
    return sum(n.meta.get(key, 0) for n in nodes)


def fast_free_schedule(graph: Graph, available_mem: int, output_size: int, debug_log: bool) -> Graph:
    """A reordered copy of ``graph`` that releases gathered parameters early (see the module docstring).

    ``available_mem`` and ``output_size`` (bytes) are accepted for DeepSpeed's signature; this greedy order does
    not depend on them. Nodes without a profiled ``tensor_size`` (not reached by the profiler) count as 0 bytes.
    """
    for node in graph.nodes:
        node.meta.setdefault("tensor_size", 0)
    state = _FreeScheduler(graph)
    while state.pending:
        tasks = state.candidates()
        free_now = [t for t in tasks if t.free_acc_mem == 0]
        if free_now:
            chosen = min(free_now, key=_free_path_allgather_key)
            state.take(chosen.schedule_until_free)
        else:
            chosen = min(tasks, key=_fallback_allgather_key)
            state.take(chosen.schedule_until_ag)
        if debug_log:
            logger.debug(f"fast_free_schedule: {chosen.node.name} free_acc_mem={chosen.free_acc_mem} "
                         f"allgather_acc_mem={chosen.allgather_acc_mem} free_cost={chosen.free_cost}")
    state.take(n for n in graph.nodes)  # the rest, in the original (topological) order
    new_graph = make_graph_from_schedule(state.order, like=graph)
    new_graph.lint()
    return new_graph
