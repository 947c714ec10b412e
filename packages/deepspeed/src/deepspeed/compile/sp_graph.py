"""FX graph helpers of AutoSP's graph pass (served from ``deepspeed.compile.util`` under DeepSpeed's names).

A graph Dynamo captured with a dynamic sequence length has a SymInt placeholder for it (named after its symbol,
e.g. ``s0``), and the tensors marked by ``prepare_autosp_inputs`` appear as placeholders whose
``meta["tensor_dict"]["tag"]`` is one of the ``constants.AUTOSP_*_KEY`` values. Sharding a marked input means
slicing it to ``[rank * (s // P), rank * (s // P) + s // P)`` along dim 1 (P = ``sp_dp_registry.sp_size()``,
rank = this rank's position in its sequence group) with nodes computing those bounds from the symbol, so the
graph stays valid for every sequence length, and rewiring every user of the input to the slice.

Nothing here imports ``util`` or ``fx`` (``util`` re-exports this module).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

import deepspeed.comm as dist
from deepspeed.compile import constants
from deepspeed.compile.custom_ops import sp_dp_registry


def get_sdpa_nodes(gm: GraphModule) -> list[Node]:
    """The ``torch.nn.functional.scaled_dot_product_attention`` calls of ``gm``, in graph order."""
    return list(gm.graph.find_nodes(op="call_function", target=F.scaled_dot_product_attention))


def _tagged(gm: GraphModule, tag: str) -> Node | None:
    for node in gm.graph.nodes:
        tensor_dict = node.meta.get("tensor_dict")
        if tensor_dict and tensor_dict.get("tag") == tag:
            return node
    return None


def get_input_id_node(gm: GraphModule) -> Node:
    """The placeholder of the tensor tagged ``AUTOSP_INPUT_ID_KEY``; ``RuntimeError`` when absent."""
    node = _tagged(gm, constants.AUTOSP_INPUT_ID_KEY)
    if node is None:
        raise RuntimeError(f"AutoSP: no graph input is tagged {constants.AUTOSP_INPUT_ID_KEY!r}; mark the token ids "
                           "with deepspeed.compile.passes.sp_compile.prepare_autosp_inputs")
    return node


def get_label_id_node(gm: GraphModule) -> Node:
    """The placeholder of the tensor tagged ``AUTOSP_LABEL_ID_KEY``; ``RuntimeError`` when absent."""
    node = _tagged(gm, constants.AUTOSP_LABEL_ID_KEY)
    if node is None:
        raise RuntimeError(f"AutoSP: no graph input is tagged {constants.AUTOSP_LABEL_ID_KEY!r}; mark the labels "
                           "with deepspeed.compile.passes.sp_compile.prepare_autosp_inputs")
    return node


def get_position_id_node(gm: GraphModule) -> Node | None:
    """The placeholder of the tensor tagged ``AUTOSP_POSITION_ID_KEY``, or None (position ids are optional)."""
    return _tagged(gm, constants.AUTOSP_POSITION_ID_KEY)


def _shape_meta(node: Node) -> Any:
    value = node.meta.get("val")
    return value if value is not None else node.meta.get("example_value")


def after_placeholders(gm: GraphModule, node: Node) -> Node:
    """Where new nodes depending on ``node`` go: after it and after every placeholder (graph inputs stay first,
    whatever order Dynamo gave the SymInt and tensor placeholders)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return max([node, *placeholders], key=order.__getitem__)


def create_shard_offsets(gm: GraphModule, s0_node: Node) -> tuple[Node, Node]:
    """Nodes computing this rank's shard bounds of a sequence of length ``s0_node``: ``chunk = s0 // P``,
    ``start = rank * chunk``, ``end = start + chunk``; returns ``(start, end)``. The rank is baked in as a
    constant: a graph is compiled per rank."""
    sp = sp_dp_registry.sp_size()
    rank = dist.get_rank() % sp
    with gm.graph.inserting_after(after_placeholders(gm, s0_node)):
        chunk = gm.graph.call_function(operator.floordiv, (s0_node, sp))
    with gm.graph.inserting_after(chunk):
        start = gm.graph.call_function(operator.mul, (rank, chunk))
    with gm.graph.inserting_after(start):
        end = gm.graph.call_function(operator.add, (start, chunk))
    return start, end


def create_symbolic_slice_indices(gm: GraphModule, sym_seq_dim_node: Node) -> tuple[Node, Node]:
    """``(slice(None, None, None), slice(start, end, None))`` as graph nodes: the index of this rank's shard of a
    ``[batch, seq, ...]`` tensor (see ``create_shard_offsets``)."""
    start, end = create_shard_offsets(gm, sym_seq_dim_node)
    with gm.graph.inserting_after(end):
        whole = gm.graph.call_function(slice, (None, None, None))
    with gm.graph.inserting_after(whole):
        shard = gm.graph.call_function(slice, (start, end, None))
    return whole, shard


def sequence_symbol_node(gm: GraphModule, tensor_node: Node) -> Node:
    """The SymInt placeholder of ``tensor_node``'s dim 1 (its sequence length)."""
    value = _shape_meta(tensor_node)
    if value is None or not hasattr(value, "shape") or len(value.shape) < 2:
        raise RuntimeError(f"AutoSP: graph input {tensor_node.name} has no [batch, seq, ...] shape metadata")
    length = value.shape[1]
    if not isinstance(length, torch.SymInt):
        raise RuntimeError(f"AutoSP: the sequence length of {tensor_node.name} is the constant {length}, not a "
                           "symbol: compile with dynamic=True or mark dim 1 dynamic (prepare_autosp_inputs does)")
    found = next((n for n in gm.graph.find_nodes(op="placeholder") if n.name == str(length)), None)
    if found is None:
        raise RuntimeError(f"AutoSP: no graph input carries the sequence length {length} of {tensor_node.name}")
    return found


def shard_tensor_node(gm: GraphModule, tensor_node: Node) -> Node:
    """Slice ``tensor_node`` to this rank's shard of dim 1 and make every other user read the slice; returns the
    slice node (``operator.getitem(tensor_node, (slice_all, slice_range))``)."""
    whole, shard = create_symbolic_slice_indices(gm, sequence_symbol_node(gm, tensor_node))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = max(shard, tensor_node, key=order.__getitem__)  # after the input and the bounds it needs
    with gm.graph.inserting_after(anchor):
        sliced = gm.graph.call_function(operator.getitem, (tensor_node, (whole, shard)))
    for user in [u for u in tensor_node.users if u is not sliced]:
        user.replace_input_with(tensor_node, sliced)
    return sliced
