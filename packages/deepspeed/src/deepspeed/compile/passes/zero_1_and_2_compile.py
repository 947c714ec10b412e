"""``zero1_compile`` / ``zero2_compile``: gradient reduction inside the compiled backward graph for ZeRO stages 1
and 2 (parameters are whole on every rank, so there is nothing to gather).

The backward graph gets a ``dc.reduce_grad(grad, graph_id, param_id)`` after each parameter's gradient, which hands
the gradient to the handle's reducer as soon as it is computed, then a ``dc.end_backward`` depending on all of them;
the graph returns None in place of each reduced gradient (the reducer owns it). The forward graph is left as it is.
Both names rewrite alike; they differ in the stage the reducer partitions gradients for, and a schedule holds one
ZeRO rewrite only (the contracts). The engine does not yet run DeepCompile over ZeRO stages 1 and 2
(``compile.zero_engine`` refuses them), so these passes are for schedules that register them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from ..fx import (
    _make_node_meta,
    add_end_backward,
    get_output_node,
    move_primals_to_head,
    replace_reduce_outputs_with_none,
    should_release_reduce_buckets,
)
from .contract import PassContract

NAME_Z1 = "zero1_compile"
NAME_Z2 = "zero2_compile"
# One ZeRO rewrite per schedule: ZeRO-1/2 reduce whole gradients where zero3_compile gathers and reduce-scatters.
CONTRACT_Z1 = PassContract(conflicts_with=frozenset({"zero3_compile"}), phase="backward")
CONTRACT_Z2 = PassContract(conflicts_with=frozenset({"zero3_compile", NAME_Z1}), phase="backward")


def add_z1_reduce_bw(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]],
                     param_manager: dict) -> GraphModule:
    """Insert the reductions into backward graph ``gm`` (see the module docstring)."""
    manager = param_manager[graph_id]
    _, grads = manager.get_bwd_mapping(gm.graph)
    output = get_output_node(gm.graph)
    for name in manager.param_names:
        grad = grads.get(name)
        if not isinstance(grad, Node):  # no gradient flows to this parameter
            continue
        param_id = manager.ds_ids[name]
        with gm.graph.inserting_after(grad):
            reduce = gm.graph.create_node("call_function", torch.ops.dc.reduce_grad.default, (grad, graph_id, param_id),
                                          name=f"reduce_param_{name}")
        reduce.meta.update(_make_node_meta(grad, param_id, True), val=None)
        # only the returned gradient goes to the reducer: other readers of the value keep reading it
        output.replace_input_with(grad, reduce)
    gm.graph = move_primals_to_head(gm.graph)
    add_end_backward(gm.graph, graph_id, should_release_reduce_buckets(graph_order, graph_id))
    replace_reduce_outputs_with_none(gm.graph)
    gm.recompile()
    return gm


def add_z1_reduce(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                  create_inputs_fn: Any, mem_budget: float, param_manager: dict, bwd: bool) -> GraphModule:
    """The ``zero1_compile`` pass."""
    return add_z1_reduce_bw(gm, graph_id, graph_order, param_manager) if bwd else gm


def add_z2_reduce(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: Any,
                  create_inputs_fn: Any, mem_budget: float, param_manager: dict, bwd: bool) -> GraphModule:
    """The ``zero2_compile`` pass (the graph rewrite is ZeRO-1's; the reducer partitions per stage)."""
    return add_z1_reduce_bw(gm, graph_id, graph_order, param_manager) if bwd else gm
