"""FX graph edits shared by DeepCompile's passes: find nodes, wrap a node's inputs or output with an operator,
end a backward graph, free activations after their last use.

Other passes may append their own small helpers here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate

from deepspeed.compile.util import get_last_uses


def get_output_node(graph: Graph) -> Node:
    for node in graph.nodes:
        if node.op == "output":
            return node
    raise ValueError("get_output_node: the graph has no output node")


def should_release_reduce_buckets(graph_order: list[tuple[int, bool]], graph_id: int) -> bool:
    """The backward of the first graph that has one runs last: it releases the reduce buckets."""
    with_backward = [g for g, needs_backward in graph_order if needs_backward]
    return not with_backward or graph_id == with_backward[0]


def add_end_backward(graph: Graph, graph_id: int, release_reduce_buckets: bool = True) -> None:
    """A ``dc.end_backward`` before the output, depending on every ``dc.reduce_grad`` of the graph (none: no-op)."""
    reduces = [n for n in graph.nodes if n.target == torch.ops.dc.reduce_grad.default]
    if not reduces:
        return
    with graph.inserting_before(get_output_node(graph)):
        graph.call_function(torch.ops.dc.end_backward.default, (reduces, graph_id, release_reduce_buckets))


def replace_reduce_outputs_with_none(graph: Graph) -> None:
    """A gradient that went to ``dc.reduce_grad`` is not returned to autograd (the handle owns it)."""
    output = get_output_node(graph)
    output.args = (map_aggregate(output.args[0], lambda n: None if isinstance(n, Node) and
                                 n.target == torch.ops.dc.reduce_grad.default else n), )


def move_primals_to_head(graph: Graph) -> Graph:
    """A copy of ``graph`` with every placeholder first."""
    ordered = [n for n in graph.nodes if n.op == "placeholder"] + [n for n in graph.nodes if n.op != "placeholder"]
    new_graph = Graph()
    env: dict[str, Node] = {}
    for node in ordered:
        env[node.name] = new_graph.node_copy(node, lambda n: env[n.name])
    new_graph.lint()
    return new_graph


def add_args_process(graph: Graph, node: Node, fn: Callable[..., Any], extra_args: list[Any] | None = None,
                     name: str | None = None, meta: dict[str, Any] | None = None) -> list[Node]:
    """Route each node argument of ``node`` through ``fn(arg, *extra_args)``; returns the new nodes."""
    created = []
    with graph.inserting_before(node):
        for arg in [a for a in node.args if isinstance(a, Node)]:
            new = graph.call_function(fn, (arg, *(extra_args or [])))
            if name is not None:
                new.name = graph._graph_namespace.create_name(name, None)
            new.meta.update(meta or {})
            node.replace_input_with(arg, new)
            created.append(new)
    return created


def add_postprocess(graph: Graph, node: Node, fn: Callable[..., Any], extra_args: list[Any] | None = None,
                    extra_kwargs: dict[str, Any] | None = None, name: str | None = None,
                    meta: dict[str, Any] | None = None) -> Node:
    """Insert ``fn(node, *extra_args, **extra_kwargs)`` right after ``node`` and make every other user of
    ``node`` read its result instead."""
    users = list(node.users)
    with graph.inserting_after(node):
        new = graph.create_node("call_function", fn, (node, *(extra_args or [])), dict(extra_kwargs or {}),
                                name=name)
    for user in users:
        user.replace_input_with(node, new)
    new.meta.update(meta or {})
    return new


def _make_node_meta(node: Node, ds_id: int, comm: bool) -> dict[str, Any]:
    meta = {"param_name": node.name, "ds_id": ds_id, "comm": comm}
    if "tensor_meta" in node.meta:
        meta["tensor_meta"] = node.meta["tensor_meta"]
    return meta


def add_free_activations(graph_id: int, graph: Graph, activation_node_names: list[str]) -> None:
    """A ``dc.free_tensors`` after the last use of each saved activation the backward graph receives (after its
    reload when it was offloaded), so its memory goes before the backward ends."""
    last_use, _ = get_last_uses(graph)
    reload_of: dict[int, Node] = {}
    waited: dict[Node, Node] = {}
    for node in graph.nodes:
        if node.target == torch.ops.dc.reload_tensor.default:
            reload_of[node.args[2]] = node.args[0]
        elif node.target == torch.ops.dc.wait_reload.default and node.args[2] in reload_of:
            waited[reload_of[node.args[2]]] = node
    activations = {n for n in graph.nodes if n.op == "placeholder" and n.name in activation_node_names}
    activations = {waited.get(n, n) for n in activations}
    freed_after: dict[Node, list[Node]] = defaultdict(list)
    for node, user in last_use.items():
        if node in activations and "tensor_meta" in node.meta and user.op != "output":
            freed_after[user].append(node)
    for user, nodes in freed_after.items():
        with graph.inserting_after(user):
            graph.call_function(torch.ops.dc.free_tensors.default, (nodes, ))


def find_node_by_name(gm: GraphModule, name: str) -> Node | None:
    return next((n for n in gm.graph.nodes if n.name == name), None)


def get_node_shape_meta(node: Node) -> Any:
    """The node's example value (``val`` from AOT autograd, ``example_value`` from Dynamo), or None."""
    value = node.meta.get("val")
    return value if value is not None else node.meta.get("example_value")


def find_node_by_tag(gm: GraphModule, tag: str) -> Node | None:
    """The node whose Dynamo ``tensor_dict`` carries ``tag`` (a tensor marked with ``tensor._tag``)."""
    for node in gm.graph.nodes:
        tensor_dict = node.meta.get("tensor_dict")
        if tensor_dict and tensor_dict.get("tag") == tag:
            return node
    return None


def replace_node_users(node: Node, replacement: Node, exclude: list[Node] | None = None) -> None:
    skip = set(exclude or [])
    for user in [u for u in node.users if u not in skip]:
        user.replace_input_with(node, replacement)
