"""AutoSP: compiler-driven Ulysses sequence parallelism for models that attend with
``torch.nn.functional.scaled_dot_product_attention``.

``prepare_autosp_inputs`` tags the token ids, labels and position ids with their sequence dimension. Before the
compiled model runs, each rank keeps its contiguous 1/P of the tagged tensors along that dimension (P = the
sequence-parallel size), so Dynamo captures the model at the local sequence length and every shape in the graph is
the shard's. While Dynamo captures it, ``UlyssesAttentionMode`` (a torch function mode, which Dynamo traces into
the graph) turns each SDPA call into the Ulysses pattern: query, key and value go through an all-to-all from
``[batch, heads, seq/P, dim]`` to ``[batch, heads/P, seq, dim]`` (each rank attends over the whole sequence for its
heads), the output through the reverse one. Attention masks are rebuilt for that layout: rows of a mask computed
from the shard are gathered, a per-head mask keeps this rank's heads (its key dimension must span the whole
sequence, e.g. built from the unsharded 2-D attention_mask). The graph pass ``autosp_pass`` then checks the captured
FX graph: it must hold SDPA, every SDPA must be wrapped, and what could not be wrapped is explained. The graph must
be whole: a graph break would cut the path from the inputs to the attention, so AutoSP compiles with
``fullgraph=True``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.overrides import TorchFunctionMode

from deepspeed.compile import all_to_all as _all_to_all
from deepspeed.compile import constants
from deepspeed.compile.custom_ops import sp_dp_registry
from deepspeed.compile.sp_graph import (
    after_placeholders,
    get_input_id_node,
    get_label_id_node,
    get_position_id_node,
    get_sdpa_nodes,
    sequence_symbol_node,
    shard_tensor_node,
)

logger = logging.getLogger(__name__)

INPUT_ID, LABEL_ID, POSITION_ID = (constants.AUTOSP_INPUT_ID_KEY, constants.AUTOSP_LABEL_ID_KEY,
                                   constants.AUTOSP_POSITION_ID_KEY)
_SHARDED_TAGS = (INPUT_ID, LABEL_ID, POSITION_ID)
SEQ_DIM_ATTR = "autosp_seq_dim"
"""The attribute holding a marked tensor's sequence dimension (absent: 1, the dimension DeepSpeed's pass uses)."""


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None, seq_dim: int = 1) -> tuple:
    """Mark the tensors AutoSP splits along the sequence (``seq_dim``): ``input_id``, ``label_id`` and, if given,
    ``position_id`` get DeepSpeed's ``tag`` (``constants.AUTOSP_*_KEY``), and every given tensor's ``seq_dim`` is
    marked dynamic for Dynamo (``maybe_mark_dynamic``: a model that needs the length constant still compiles).
    Returns ``(input_id, label_id, position_id, attention_mask)``; the attention mask is not sharded (its key
    dimension must cover the full sequence)."""
    if input_id is None:
        raise ValueError("prepare_autosp_inputs: input_id is required")
    if label_id is None:
        raise ValueError("prepare_autosp_inputs: label_id is required")
    named = {"input_id": input_id, "label_id": label_id, "position_id": position_id,
             "attention_mask": attention_mask}
    for name, tensor in named.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"prepare_autosp_inputs: {name} must be a tensor, got {type(tensor).__name__}")
        if not 0 <= seq_dim < tensor.dim():
            raise ValueError(f"prepare_autosp_inputs: seq_dim={seq_dim} is not a dimension of {name} (shape "
                             f"{tuple(tensor.shape)})")
        if tensor.shape[seq_dim] != input_id.shape[seq_dim]:
            raise ValueError(f"prepare_autosp_inputs: {name} has {tensor.shape[seq_dim]} positions along seq_dim="
                             f"{seq_dim}, input_id has {input_id.shape[seq_dim]}")
        torch._dynamo.maybe_mark_dynamic(tensor, seq_dim)  # a hint: code that specializes it is no error
    for tag, tensor in ((INPUT_ID, input_id), (LABEL_ID, label_id), (POSITION_ID, position_id)):
        if tensor is not None:
            tensor.tag = tag
            setattr(tensor, SEQ_DIM_ATTR, seq_dim)
    return input_id, label_id, position_id, attention_mask


def autosp_tag(value: Any) -> tuple[str, int] | None:
    """``(role, seq_dim)`` of a tensor marked for sharding (by ``prepare_autosp_inputs``, or by hand with
    ``tensor.tag = constants.AUTOSP_INPUT_ID_KEY`` etc.: sequence dimension 1), else None."""
    tag = getattr(value, "tag", None) if isinstance(value, torch.Tensor) else None
    if isinstance(tag, str) and tag in _SHARDED_TAGS:
        return tag, getattr(value, SEQ_DIM_ATTR, 1)
    return None


def shard_inputs(value: Any, group: Any) -> Any:
    """``value`` (tensors, possibly in tuples, lists and dicts) with every marked tensor replaced by this rank's
    contiguous part of its sequence dimension."""
    tag = autosp_tag(value)
    if tag is not None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        length = value.shape[tag[1]]
        if length % world:
            raise ValueError(f"AutoSP: the {tag[0]} sequence length ({length}, dim {tag[1]}) must be divisible by "
                             f"sequence_parallel_size ({world})")
        return value.narrow(tag[1], rank * (length // world), length // world)
    if isinstance(value, (tuple, list)):
        return type(value)(shard_inputs(v, group) for v in value)
    if isinstance(value, dict):
        return {k: shard_inputs(v, group) for k, v in value.items()}
    return value


def has_marked_inputs(value: Any) -> bool:
    if autosp_tag(value) is not None:
        return True
    if isinstance(value, (tuple, list)):
        return any(has_marked_inputs(v) for v in value)
    if isinstance(value, dict):
        return any(has_marked_inputs(v) for v in value.values())
    return False


# ---- capture: SDPA -> all-to-all, SDPA, all-to-all ------------------------------------------------------------
def _attention_problem(q: Any, k: Any, v: Any, mask: Any, world: int) -> str | None:
    """Why this SDPA call cannot run as Ulysses over ``world`` ranks (None: it can)."""
    for role, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return f"AutoSP expects 4-D [batch, heads, seq, head_dim] SDPA {role} tensors, got {shape}"
        if t.shape[1] % world:
            return (f"AutoSP: the number of {role} heads ({t.shape[1]}) must be divisible by sequence_parallel_size "
                    f"({world})")
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        return None
    local, keys = q.shape[2], mask.shape[-1]
    if keys == local and keys != 1:
        return (f"AutoSP cannot rebuild an attention mask whose key dimension is sharded along the sequence (mask "
                f"shape {tuple(mask.shape)}, {local} local positions): build it from the whole sequence, e.g. "
                "from the 2-D attention_mask, which prepare_autosp_inputs keeps whole")
    if mask.dim() == 4 and mask.shape[1] not in (1, q.shape[1]):
        return (f"AutoSP: the head dimension of the attention mask {tuple(mask.shape)} must be 1 or the number of "
                f"query heads ({q.shape[1]})")
    return None


def _mask_for_full_queries(mask: torch.Tensor, local: int, heads: int, group: int, world: int,
                           rank: int) -> torch.Tensor:
    """The mask for the all-to-all layout: whole query rows, this rank's (``rank`` in the group) heads."""
    rows_sharded = mask.dim() >= 2 and mask.shape[-2] == local and local != 1
    if mask.dim() == 4 and mask.shape[1] == heads and heads != 1:
        if rows_sharded:  # the query's own redistribution
            return _all_to_all.all_to_all(mask, 1, 2, group)
        return mask.narrow(1, rank * (heads // world), heads // world)
    if rows_sharded:
        return _all_to_all.all_gather(mask, mask.dim() - 2, group)
    return mask


class UlyssesAttentionMode(TorchFunctionMode):
    """While ``torch.compile`` captures a graph, records every ``scaled_dot_product_attention`` as Ulysses attention
    over the registered group ``group`` (calls it cannot run that way are left alone; ``autosp_pass`` reports
    them). Outside graph capture it changes nothing."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group, self.world = group, _all_to_all.group_size(group)
        self.rank = dist.get_rank(_all_to_all.group_of(group))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # only while Dynamo captures the graph: when a backend runs the captured graph as Python (eager,
        # aot_eager) its SDPA calls, already between the all-to-alls, come through this mode again
        if func is not F.scaled_dot_product_attention or not torch.compiler.is_compiling():
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask")
        given = dict(zip(names, args, strict=False)) | {n: kwargs[n] for n in names if n in kwargs}
        others = {n: value for n, value in kwargs.items() if n not in names}  # dropout_p, is_causal, scale, ...
        q, k, v, mask = (given.get(n) for n in names)
        if _attention_problem(q, k, v, mask, self.world) is not None:
            return func(*args, **kwargs)
        if isinstance(mask, torch.Tensor):
            mask = _mask_for_full_queries(mask, q.shape[2], q.shape[1], self.group, self.world, self.rank)
        q, k, v = (_all_to_all.all_to_all(t, 1, 2, self.group) for t in (q, k, v))  # heads out, sequence in
        out = func(q, k, v, mask, *args[len(names):], **others)
        return _all_to_all.all_to_all(out, 2, 1, self.group)  # sequence out, heads back


# ---- the graph pass --------------------------------------------------------------------------------------------
def _meta(node: Any) -> Any:
    if not isinstance(node, Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def _is_exchange(node: Any) -> bool:
    return isinstance(node, Node) and node.target is torch.ops.ds_autosp.all_to_all.default


def autosp_pass(gm: GraphModule, group: int) -> GraphModule:
    """Check the captured graph: it has SDPA, and every SDPA runs between the Ulysses all-to-alls over ``group``;
    an SDPA that could not be wrapped raises the reason."""
    nodes = get_sdpa_nodes(gm)
    if not nodes:
        raise RuntimeError("AutoSP found no torch.nn.functional.scaled_dot_product_attention in the compiled graph; "
                           "AutoSP supports SDPA attention only")
    world = _all_to_all.group_size(group)
    for node in nodes:
        names = ("query", "key", "value", "attn_mask")
        given = dict(zip(names, node.args, strict=False)) | {n: node.kwargs[n] for n in names if n in node.kwargs}
        inputs = [given.get(n) for n in names[:3]]
        wrapped = all(_is_exchange(t) for t in inputs) and len(node.users) > 0 and all(
            _is_exchange(u) for u in node.users)
        if not wrapped:
            problem = _attention_problem(*(_meta(given.get(n)) for n in names), world)
            raise RuntimeError(problem or f"AutoSP could not wrap the attention {node.format_node()} in all-to-alls")
    return gm


# ---- DeepSpeed's graph-level form: the whole sequence enters the graph and the graph shards it ----------------
# ``apply_autosp`` (what ``init_sp.init_autosp``'s backend runs) takes a graph Dynamo captured with a symbolic
# sequence length ``s`` from the whole, tagged inputs: it slices the tagged inputs to this rank's ``s // P`` rows
# inside the graph, makes the shape arithmetic downstream of them use ``s // P``, and puts the Ulysses all-to-alls
# around every SDPA. Nodes not computed from the tagged inputs keep the whole length: an attention mask built from
# the whole attention_mask or from cache positions matches the all-to-all layout (every rank attends over the
# whole sequence for its heads). A mask computed from the sharded inputs is not rebuilt: use the engine's AutoSP
# (``engine.compile`` with the ``autosp`` pass), which does, for such models.
def pass_shard_seq_dim(gm: GraphModule, example_inputs: Any) -> None:
    """Make every use of the sequence-length symbol downstream of the tagged inputs read ``s // P`` instead."""
    ids = get_input_id_node(gm)
    symbol = sequence_symbol_node(gm, ids)
    length = _meta(symbol)
    # Dynamo may lift the same length more than once (placeholders named differently, one value)
    same = [n for n in gm.graph.find_nodes(op="placeholder") if isinstance(_meta(n), torch.SymInt)
            and _meta(n).node.expr == length.node.expr]
    locals_ = {}
    for node in same:
        with gm.graph.inserting_after(after_placeholders(gm, node)):
            locals_[node] = gm.graph.call_function(operator.floordiv, (node, sp_dp_registry.sp_size()))
    tagged = [n for n in (ids, get_label_id_node(gm), get_position_id_node(gm)) if n is not None]
    seen, todo = set(), list(tagged)
    while todo:  # everything computed from the tagged inputs
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    for node in seen:
        for whole, local in locals_.items():
            if whole in node.all_input_nodes:
                node.replace_input_with(whole, local)


def pass_shard_input_ids(gm: GraphModule, example_inputs: Any) -> None:
    shard_tensor_node(gm, get_input_id_node(gm))


def pass_shard_label_ids(gm: GraphModule, example_inputs: Any) -> None:
    shard_tensor_node(gm, get_label_id_node(gm))


def pass_shard_position_ids(gm: GraphModule, example_inputs: Any) -> None:
    node = get_position_id_node(gm)
    if node is None:  # optional: models may derive positions themselves
        logger.warning("AutoSP: no input is tagged %r; position ids are not sharded", POSITION_ID)
        return
    shard_tensor_node(gm, node)


def _exchange_after(gm: GraphModule, node: Node, scatter: int, gather: int, group: int) -> Node:
    with gm.graph.inserting_after(node):
        return gm.graph.call_function(torch.ops.ds_autosp.all_to_all.default, (node, scatter, gather, group))


def pass_insert_attention_all_to_all(gm: GraphModule, example_inputs: Any) -> None:
    """Query, key and value of every SDPA go from ``[b, heads, s/P, d]`` to ``[b, heads/P, s, d]``, its output back."""
    nodes = get_sdpa_nodes(gm)
    if not nodes:
        raise RuntimeError("AutoSP found no torch.nn.functional.scaled_dot_product_attention in the compiled graph; "
                           "AutoSP supports SDPA attention only")
    sp = sp_dp_registry.sp_size()
    key = _all_to_all.register_group(sp_dp_registry.get_group(dist.get_rank() // sp))
    for node in nodes:
        names = ("query", "key", "value")
        given = dict(zip(names, node.args, strict=False)) | {n: node.kwargs[n] for n in names if n in node.kwargs}
        for name in names:
            value = _meta(given.get(name))
            if not isinstance(value, torch.Tensor) or value.dim() != 4 or value.shape[1] % sp:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                raise RuntimeError(f"AutoSP: SDPA {name} {node.name} must be [batch, heads, seq, head_dim] with heads "
                                   f"divisible by the sequence parallel size ({sp}), got {shape}")
        for source in dict.fromkeys(given[n] for n in names):  # a tensor used twice is exchanged once
            node.replace_input_with(source, _exchange_after(gm, source, 1, 2, key))
        users = list(node.users)
        out = _exchange_after(gm, node, 2, 1, key)
        for user in users:
            user.replace_input_with(node, out)


def pass_propagate_shapes(gm: GraphModule, example_inputs: Any) -> None:
    """Recompute every node's fake value from the graph's own fake inputs (same shape environment)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [_meta(n) for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = next((v.fake_mode for v in inputs if isinstance(v, torch._subclasses.FakeTensor)), None)
    if fake_mode is None:
        raise RuntimeError("AutoSP: the captured graph carries no fake input values to propagate shapes from")
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta and "example_value" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def pass_canonicalize(gm: GraphModule, example_inputs: Any) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


AUTOSP_PASSES = (pass_shard_seq_dim, pass_shard_input_ids, pass_shard_label_ids, pass_shard_position_ids,
                 pass_insert_attention_all_to_all, pass_propagate_shapes, pass_canonicalize)


def apply_autosp(gm: GraphModule, real_inputs: Any, debug: bool = False, passes: list[Callable] | None = None,
                 sp_size: int = 2, dp_size: int = 1) -> GraphModule:
    """Run AutoSP's graph passes (``AUTOSP_PASSES`` unless ``passes`` is given) on ``gm`` in place over the mesh of
    ``dp_size`` sequence groups of ``sp_size`` ranks (built once, ``sp_dp_registry.populate_registry``); with
    ``debug`` rank 0 logs the graph after each pass."""
    if sp_size * dp_size > dist.get_world_size():
        raise ValueError(f"apply_autosp: sp_size * dp_size = {sp_size * dp_size} exceeds the world size "
                         f"({dist.get_world_size()})")
    sp_dp_registry.populate_registry(sp_size, dp_size)
    if sp_dp_registry.sp_size() != sp_size:
        raise ValueError(f"apply_autosp: sp_size={sp_size}, but the AutoSP mesh was built with "
                         f"{sp_dp_registry.sp_size()} ranks per sequence group")
    for p in AUTOSP_PASSES if passes is None else passes:
        p(gm, real_inputs)
        if debug and dist.get_rank() == 0:
            logger.info("AutoSP graph after %s:\n%s", p.__name__, gm.print_readable(print_output=False))
    return gm
