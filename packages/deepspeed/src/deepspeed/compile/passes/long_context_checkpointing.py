"""AutoSP's memory optimization: selective activation checkpointing of the compiled graph (spec 2.1.10, "Memory
Optimization").

Long sequences make attention the expensive part of a layer (quadratic in the sequence) while the matmuls around it
grow linearly and are cheap to redo. So the backward recomputes the matmuls (and the cheap elementwise work around
them) instead of keeping their outputs, and keeps what attention produced: its output and softmax statistics. The
Ulysses all-to-alls and mask gathers are kept too, so the backward never replays communication.

Built on torch's own selective checkpointing: the graph Dynamo captured becomes the body of the
``tag_activation_checkpoint`` higher-order op (what ``torch.utils.checkpoint`` turns into under ``torch.compile``)
with a ``create_selective_checkpoint_contexts`` policy. AOT autograd tags every traced op with the policy's choice
and its min-cut partitioner (used by ``aot_eager`` and Inductor) honours the tags when it splits forward and
backward; an eager backend runs the same policy through ``torch.utils.checkpoint``. Attention is recognised by
SDPA's fused kernels (flash, efficient, cuDNN, the CPU flash kernel); where SDPA falls back to its unfused math
decomposition its matmuls count as matmuls.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

enabled = True
"""AutoSP compiles with the optimization (the spec makes it part of AutoSP); a switch for measurements only."""


def register_long_context_checkpointing() -> None:
    """DeepSpeed's entry point: turn the optimization on for AutoSP backends built from now on (it is on by
    default; here it changes no torch internals, the policy travels with each compiled graph)."""
    global enabled
    enabled = True

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def _attention_ops() -> set:
    """The fused SDPA kernels (forward) whose outputs are kept; those missing from this build are skipped."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward")
    return {getattr(_aten, n).default for n in names if hasattr(_aten, n)}


_SAVED = _attention_ops()


def autosp_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing policy: keep attention and the AutoSP collectives, recompute matmuls, let the
    partitioner choose for the rest (eager checkpointing recomputes it)."""
    if op in _SAVED or getattr(op, "namespace", None) == "ds_autosp":
        return CheckpointPolicy.MUST_SAVE
    if op in _MATMULS:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn() -> tuple:
    return create_selective_checkpoint_contexts(autosp_policy)


def selective_checkpoint(gm: GraphModule) -> GraphModule:
    """A graph module computing what ``gm`` (a Dynamo graph returning a tuple) computes, as the body of one
    selectively checkpointed region under ``autosp_policy``."""
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    gm.meta["_checkpoint_context_fn"] = _context_fn  # read by the higher-order op
    graph = Graph()
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        copy = graph.placeholder(node.target)
        copy.meta.update(node.meta)
        inputs.append(copy)
    body = graph.get_attr("autosp_body")
    call = graph.call_function(tag_activation_checkpoint, (body, *inputs))
    (results,) = gm.graph.find_nodes(op="output")[0].args
    if not isinstance(results, (tuple, list)):
        raise RuntimeError(f"AutoSP expects the captured graph to return a tuple, got {type(results).__name__}")
    outputs = []
    for i, result in enumerate(results):
        item = graph.call_function(operator.getitem, (call, i))
        if isinstance(result, torch.fx.Node):
            item.meta.update({k: v for k, v in result.meta.items() if k in ("example_value", "val")})
        outputs.append(item)
    graph.output(tuple(outputs))
    root = torch.nn.Module()
    root.autosp_body = gm
    wrapped = GraphModule(root, graph)
    wrapped.meta.update({k: v for k, v in gm.meta.items() if k != "_checkpoint_context_fn"})
    return wrapped
