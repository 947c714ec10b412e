"""The joint-graph partitioner hook of DeepCompile's ZeRO-3 (``get_wrapped_partitioner``).

AOT Autograd splits the joint forward+backward graph into a forward and a backward graph before DeepCompile's
passes run, and it knows nothing about sharding: left alone, it would save for backward every view or dtype cast of
a gathered parameter, keeping whole parameters alive between forward and backward, which is the memory ZeRO-3
exists to save. The hook marks those aliases ``MUST_RECOMPUTE`` so the min-cut partitioner recomputes them in the
backward (from the parameter, gathered again there) instead. Everything else keeps the partitioner's own policy.
It also records how many forward outputs the caller receives, which later passes need and only the partitioner
knows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .util import get_no_copy_ops, is_cast_op


def _is_primal(node: Node) -> bool:
    """A joint-graph input that is a forward input (not a tangent or an RNG seed/offset)."""
    if node.op != "placeholder":
        return False
    target = str(node.target)
    return not any(tag in target for tag in ("tangents", "fwd_seed", "fwd_base_offset", "bwd_seed",
                                             "bwd_base_offset"))


def _recompute_param_aliases(joint_graph: Graph, param_indices: list[tuple[int, int, torch.Size]]) -> None:
    """Mark every no-copy view or dtype cast of a ZeRO-3 parameter (transitively) ``MUST_RECOMPUTE``.

    ``param_indices``: ``(index among the primal inputs, ds_id, partitioned shape)`` per parameter input. Every
    node gets ``ac_graph_id`` (1 where absent): the min-cut partitioner requires it on all nodes, and one id for
    the whole graph keeps it from forcing saves at checkpoint-region borders that do not exist here.
    """
    no_copy_ops = get_no_copy_ops()
    primals = [n for n in joint_graph.nodes if _is_primal(n)]
    aliases: set[Node] = {primals[i] for i, _ds_id, _shape in param_indices}
    for node in joint_graph.nodes:
        node.meta.setdefault("ac_graph_id", 1)
        if node.op != "call_function":
            continue
        if not (node.target in no_copy_ops or is_cast_op(node)[0]):
            continue
        # args may hold unhashable values: test membership only for nodes
        if any(isinstance(a, Node) and a in aliases for a in node.args):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            aliases.add(node)


# Forward outputs the caller receives, per Dynamo frame id; later forward outputs are values saved for backward.
_num_fwd_outputs_by_frame: dict[int, int] = {}


def get_num_fwd_outputs(frame_id: int) -> int | None:
    return _num_fwd_outputs_by_frame.get(frame_id)


def get_wrapped_partitioner(z3_partition: bool, param_indices: list[tuple[int, int, torch.Size]],
                            partition_fn: Callable[..., tuple[GraphModule, GraphModule]], frame_id: int,
                            frames_partitioned: set[int]) -> Callable[..., tuple[GraphModule, GraphModule]]:
    """``partition_fn`` (e.g. ``min_cut_rematerialization_partition``) with the ZeRO-3 recompute marks applied
    first (when ``z3_partition``); records ``frame_id`` in ``frames_partitioned`` and its forward output count."""

    def partition_recompute_ds_params(joint_module: GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                                      **kwargs: Any) -> tuple[GraphModule, GraphModule]:
        frames_partitioned.add(frame_id)
        _num_fwd_outputs_by_frame[frame_id] = num_fwd_outputs
        if z3_partition:
            _recompute_param_aliases(joint_module.graph, param_indices)
        return partition_fn(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    return partition_recompute_ds_params
