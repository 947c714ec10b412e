"""DeepCompile pass ``autotp``: the tensor-parallel collectives of an AutoTP-partitioned model as graph nodes.

AutoTP has already replaced the model's linears by its sharded layers, whose forward calls the collectives
itself. :func:`defer_collectives_to_compiler` turns that off on every layer the pass can handle (all of them or
none), and :func:`apply_autotp` rewrites the Dynamo graph: each matmul traced from a row-parallel layer gets
``autotp.reduce_from_tp_region`` after it (every reader takes the reduced value), and each group of matmuls
traced from column-parallel layers that share one input gets a single ``autotp.copy_to_tp_region`` in front
(identity forward, all-reduce of the input gradient backward). Only the matmul inputs go through it, so a residual
branch reading the same activation keeps its unreduced gradient. A ``gather_output`` layer's all-gather stays in
the layer's forward (as the ``autotp.gather_from_tp_region`` op) because it changes the traced width.

A layer is recognised by the innermost module in a node's ``nn_module_stack``, so subclasses (fused QKV, packed
gate/up, conv, Yuan, shaped sub-parameters) are handled with their base family. ``LmHeadLinearAllreduce`` slices
its own input before reducing, which this rewrite cannot express: a model containing one is refused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from deepspeed.module_inject.layers import (
    LinearAllreduce,
    LinearLayer,
    LmHeadLinearAllreduce,
    SubParamLinearAllreduce,
    SubParamLinearLayer,
    TensorParallel_Layer,
)

from ..custom_ops import tp_collectives  # noqa: F401 - defines the torch.ops.autotp operators

COLUMN_PARALLEL_OP = torch.ops.autotp.copy_to_tp_region.default
ROW_PARALLEL_OP = torch.ops.autotp.reduce_from_tp_region.default
GATHER_OUTPUT_OP = torch.ops.autotp.gather_from_tp_region.default

COLUMN_PARALLEL_LAYERS = (LinearLayer, SubParamLinearLayer)
ROW_PARALLEL_LAYERS = (LinearAllreduce, SubParamLinearAllreduce)
UNSUPPORTED_LAYERS = (LmHeadLinearAllreduce, )

# how a layer's matmul appears in a Dynamo graph (F.linear, torch.matmul, ``@``) or an ATen one
_MATMUL_TARGETS = frozenset({
    torch._C._nn.linear,
    torch.nn.functional.linear,
    torch.matmul,
    operator.matmul,
    torch.ops.aten.linear.default,
    torch.ops.aten.matmul.default,
})


def _in_family(layer_type: Any, family: tuple[type, ...]) -> bool:
    return isinstance(layer_type, type) and not issubclass(layer_type, UNSUPPORTED_LAYERS) \
        and issubclass(layer_type, family)


def is_column_parallel(layer_type: Any) -> bool:
    return _in_family(layer_type, COLUMN_PARALLEL_LAYERS)


def is_row_parallel(layer_type: Any) -> bool:
    return _in_family(layer_type, ROW_PARALLEL_LAYERS)


def defer_collectives_to_compiler(model: torch.nn.Module) -> None:
    """Make every tensor-parallel layer of ``model`` leave its f/g collectives to the compiled graph.

    All or nothing: the check covers every layer before any flag is set, so a refused model keeps all its
    module-level collectives (a caller falling back to eager training stays correct)."""
    deferred = []
    for name, module in model.named_modules():
        if not isinstance(module, TensorParallel_Layer) or getattr(module, "mp_group", None) is None:
            continue
        layer_type = type(module)
        if not (is_column_parallel(layer_type) or is_row_parallel(layer_type)):
            raise NotImplementedError(
                f"AutoTP compile pass cannot rewrite '{name}' ({layer_type.__name__}): its collectives are not the "
                "f/g pair around one matmul, and under a full graph its module-level backward collective would be "
                "lost. Remove 'autotp' from compile.passes for this model.")
        if getattr(layer_type, "tp_overlap_comm", False):
            raise NotImplementedError(f"AutoTP compile pass cannot rewrite '{name}': tp_overlap_comm overlaps the "
                                      "collective inside the layer; set 'tp_overlap_comm': false")
        deferred.append(module)
    for module in deferred:
        module.defer_collectives_to_compiler = True


def _layer_type(node: Node) -> Any:
    """The type of the innermost module ``node`` was traced from (None outside any module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    _path, module_type = list(stack.values())[-1]
    return module_type


def _emit_row_reduce(gm: GraphModule, matmul: Node) -> None:
    with gm.graph.inserting_after(matmul):
        reduced = gm.graph.call_function(ROW_PARALLEL_OP, (matmul, ))
    if "val" in matmul.meta:
        reduced.meta["val"] = matmul.meta["val"]
    matmul.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)


def _emit_column_copy(gm: GraphModule, activation: Node, matmuls: Sequence[Node]) -> None:
    with gm.graph.inserting_before(matmuls[0]):
        copied = gm.graph.call_function(COLUMN_PARALLEL_OP, (activation, ))
    if "val" in activation.meta:
        copied.meta["val"] = activation.meta["val"]
    for matmul in matmuls:
        matmul.replace_input_with(activation, copied)


def pass_insert_tp_collectives(gm: GraphModule, example_inputs: Any = None) -> None:
    """Insert g after row-parallel matmuls and one f per shared input of column-parallel matmuls."""
    column_groups: dict[Node, list[Node]] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MATMUL_TARGETS:
            continue
        layer_type = _layer_type(node)
        if is_row_parallel(layer_type):
            _emit_row_reduce(gm, node)
        elif is_column_parallel(layer_type) and isinstance(node.args[0], Node):
            column_groups.setdefault(node.args[0], []).append(node)
    for activation, matmuls in column_groups.items():
        _emit_column_copy(gm, activation, matmuls)


def pass_canonicalize(gm: GraphModule, example_inputs: Any = None) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


AUTOTP_PASSES: list[Callable[[GraphModule, Any], None]] = [pass_insert_tp_collectives, pass_canonicalize]


def apply_autotp(gm: GraphModule, example_inputs: Any = None,
                 passes: Sequence[Callable[[GraphModule, Any], None]] | None = None) -> GraphModule:
    """Run the AutoTP graph passes on ``gm`` in place and return it."""
    for graph_pass in passes or AUTOTP_PASSES:
        graph_pass(gm, example_inputs)
    return gm
