"""``offload_parameters``: keep ZeRO-3 partitions in host memory outside the forward span that needs them.

For every ``allgather_param`` in the forward graph the pass adds ``dc.reload_parameter`` (the partition back to
the device) after the graph's inputs, and ``dc.offload_parameter`` (the partition to the host) right after the last
use of the gathered value, so a partition occupies device memory only from the start of the graph to its last use.
Passes added after it keep the pair in place: ``prefetch`` never moves a gather above the reload of its parameter.
"""

from __future__ import annotations

from typing import Any

from torch.fx import GraphModule, Node

from ..list_schedule import dc_op
from ..util import get_last_uses
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "offload_parameters"
# Wraps the all-gathers zero3_compile inserted.
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))  # forward and backward graphs


def get_ds_id(node: Node) -> int:
    if node.target != dc_op("allgather_param"):
        raise ValueError(f"get_ds_id: {node.name} is not a dc.allgather_param node (target {node.target})")
    return node.args[2]


def _insert_after(gm: GraphModule, where: Node, op_name: str, arg: Node, graph_id: int, ds_id: int) -> Node:
    if where.op == "output":  # nothing may follow the output node
        where = where.prev
    with gm.graph.inserting_after(where):
        return gm.graph.create_node("call_function", dc_op(op_name), (arg, graph_id, ds_id), {}, name=op_name)


def add_reload_parameter(graph_id: int, gm: GraphModule, node: Node, ds_id: int, after: Node | None = None) -> Node:
    """``dc.reload_parameter(node, graph_id, ds_id)`` (``node``: the parameter input) placed after ``after``
    (default: ``node``)."""
    return _insert_after(gm, node if after is None else after, "reload_parameter", node, graph_id, ds_id)


def add_offload_parameter(graph_id: int, gm: GraphModule, node: Node, ds_id: int) -> Node:
    """``dc.offload_parameter(node, graph_id, ds_id)`` right after ``node``, the last use of the gathered value:
    taking it as the argument keeps any later reordering from moving the offload above that use."""
    return _insert_after(gm, node, "offload_parameter", node, graph_id, ds_id)


def offload_parameter_fwd(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                          create_inputs_fn: Any, mem_budget: float, param_manager: Any, bwd: bool) -> GraphModule:
    """Add the reload/offload pairs (see the module docstring). Backward graphs get them too: their all-gathers
    need the partition back on the device after the forward offloaded it."""
    last_use = get_last_uses(gm.graph)[0]
    allgather = dc_op("allgather_param")
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = inputs[-1] if inputs else None
    for ag in [n for n in gm.graph.nodes if n.target == allgather]:
        ds_id = get_ds_id(ag)
        param = ag.args[0]
        # reloads go after the inputs, in all-gather order, keeping the inputs contiguous
        where = anchor if param.op == "placeholder" and anchor is not None else param
        reload = add_reload_parameter(graph_id, gm, param, ds_id, after=where)
        if where is anchor:
            anchor = reload
        add_offload_parameter(graph_id, gm, last_use.get(ag, ag), ds_id)
    gm.graph.lint()
    gm.recompile()
    return gm
