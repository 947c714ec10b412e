"""ZeRO-3 in the graph (``add_z3_gather_release``, registered as ``zero3_compile``).

Forward graph: every parameter placeholder (a released ZeRO-3 parameter) feeds a ``dc.allgather_param`` +
``dc.wait_allgather`` whose result replaces it for every reader; after each real reader (looking through views)
a ``dc.release_param`` passes that reader's value on, so the whole parameter is dropped once its readers ran. A
parameter whose only reader is a down-cast (autocast) is gathered in the smaller dtype directly.

Backward graph: the same for the parameters it reads; each parameter gradient goes to ``dc.reduce_grad`` (the
engine's reduce-scatter into the gradient partitions) and is not returned to autograd (a released parameter has
no room for a whole gradient); a ``dc.end_backward`` after the reductions closes the graph's backward.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from deepspeed.compile.fx import (
    _make_node_meta,
    add_end_backward,
    add_postprocess,
    get_output_node,
    move_primals_to_head,
    replace_reduce_outputs_with_none,
    should_release_reduce_buckets,
)
from deepspeed.compile.passes.contract import CAP_Z3_GATHER_RELEASE, PassContract
from deepspeed.compile.util import get_deepcompile_handle, get_param_nodes, get_real_uses, is_cast_op

NAME = "zero3_compile"
CONTRACT = PassContract(provides=frozenset({CAP_Z3_GATHER_RELEASE}))


def add_allgather(graph_id: int, graph: Graph, node: Node, ds_id: int, dtype: torch.dtype) -> Node:
    """Gather ``node`` (a parameter placeholder) for every reader except the graph output."""
    gather = add_postprocess(graph, node, torch.ops.dc.allgather_param.default, extra_args=[graph_id, ds_id],
                             extra_kwargs={"dtype": dtype}, name=f"allgather_ds_param_{node.target}_{ds_id}",
                             meta=_make_node_meta(node, ds_id, True))
    if "val" in node.meta:
        gather.meta["val"] = node.meta["val"].to(dtype)
    get_output_node(graph).replace_input_with(gather, node)  # the graph still returns the parameter itself
    wait = add_postprocess(graph, gather, torch.ops.dc.wait_allgather.default, extra_args=[graph_id, ds_id],
                           name=f"wait_allgather_ds_param_{node.target}_{ds_id}",
                           meta=_make_node_meta(node, ds_id, False))
    if "val" in gather.meta:
        wait.meta["val"] = gather.meta["val"]
    return gather


def add_release(graph_id: int, graph: Graph, node: Node, param_node: Node, ds_id: int, n_users: int) -> None:
    """``dc.release_param`` on ``node``'s value (passed on to its readers): one reader of the parameter is done."""
    release = add_postprocess(graph, node, torch.ops.dc.release_param.default, extra_args=[graph_id, ds_id, n_users],
                              name=f"release_ds_param_{param_node.target}_{node.name}_{ds_id}",
                              meta=_make_node_meta(node, ds_id, False))
    release.meta["val"] = None


def add_reduce(graph_id: int, graph: Graph, grad_node: Node, param_name: str, ds_id: int) -> None:
    reduce = add_postprocess(graph, grad_node, torch.ops.dc.reduce_grad.default, extra_args=[graph_id, ds_id],
                             name=f"reduce_ds_param_{param_name}", meta=_make_node_meta(grad_node, ds_id, True))
    reduce.meta["val"] = None


def _fused_cast(node: Node, dtype: torch.dtype) -> tuple[Node | None, torch.dtype]:
    """The parameter's only reader when it is a cast to a smaller dtype (gather in that dtype), else None."""
    readers = [u for u in node.users if u.op != "output"]
    if len(readers) == 1:
        is_cast, cast_dtype = is_cast_op(readers[0])
        if is_cast and cast_dtype.itemsize < dtype.itemsize:
            return readers[0], cast_dtype
    return None, dtype


def add_gather_and_release(graph_id: int, graph: Graph, param_manager: Any, param_nodes: list[Node]) -> Graph:
    uses = get_real_uses(graph)
    for node in param_nodes:
        if not node.users:
            continue
        ds_id = param_manager.ds_ids[node.name]
        cast, dtype = _fused_cast(node, param_manager.params[node.name].dtype)
        add_allgather(graph_id, graph, node, ds_id, dtype)
        if cast is not None:
            readers = uses[cast]
            wait = cast.args[0]
            for user in list(cast.users):
                if user.op == "output":
                    wait.meta["original_output_name"] = cast.name
                user.replace_input_with(cast, wait)
            graph.erase_node(cast)
        else:
            readers = uses[node]
        for reader in readers:
            # release_param takes a tensor: a reader returning a tuple is released after its first getitem
            item = next((u for u in reader.users if u.op == "call_function" and u.target == operator.getitem), None)
            add_release(graph_id, graph, item if item is not None else reader, node, ds_id, len(readers))
    return move_primals_to_head(graph)


def add_gather_and_reduce(graph_id: int, graph: Graph, param_manager: Any, param_nodes_bw: list[Node],
                          param_name_to_grad: dict[str, Any]) -> Graph:
    add_gather_and_release(graph_id, graph, param_manager, param_nodes_bw)
    grads = param_manager.get_bwd_mapping(graph)[1]  # the nodes of the graph just rebuilt
    for name in param_manager.param_names:
        if isinstance(grads.get(name), Node):
            add_reduce(graph_id, graph, grads[name], name, param_manager.ds_ids[name])
    return move_primals_to_head(graph)


def _empty_param_meta(gm: GraphModule, names: set[str]) -> None:
    """Parameter placeholders hold released (empty) tensors at run time (Inductor checks input metadata)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in names and "val" in node.meta:
            val = node.meta["val"]
            node.meta["val"] = torch.empty([0], dtype=val.dtype, device=val.device)


def add_z3_gather_release(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]],
                          profiling_results: dict, create_inputs_fn: Any, mem_budget: float, param_manager: dict,
                          bwd: bool) -> GraphModule:
    """The pass (see the module docstring)."""
    manager = param_manager[graph_id]
    if bwd:
        nodes_bw, grads = manager.get_bwd_mapping(gm.graph)
        gm.graph = add_gather_and_reduce(graph_id, gm.graph, manager, nodes_bw, grads)
        add_end_backward(gm.graph, graph_id, should_release_reduce_buckets(graph_order, graph_id))
        replace_reduce_outputs_with_none(gm.graph)
        return gm
    indices = profiling_results[graph_id].param_indices
    gm.graph = add_gather_and_release(graph_id, gm.graph, manager, get_param_nodes(gm.graph, indices))
    get_deepcompile_handle().register_graph_z3(graph_id, [ds_id for _, ds_id, _ in indices])
    _empty_param_meta(gm, set(manager.ds_ids))
    return gm
