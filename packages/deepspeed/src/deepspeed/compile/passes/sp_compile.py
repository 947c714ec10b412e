"""AutoSP: compiler-driven Ulysses sequence parallelism for models that attend with
``torch.nn.functional.scaled_dot_product_attention``.

Every rank passes the whole sequence. ``prepare_autosp_inputs`` tags the token ids, labels and position ids
(``tensor.tag = constants.AUTOSP_*_KEY``, DeepSpeed's marker) and marks their sequence dimension dynamic, so Dynamo
captures the model with the sequence length as a symbol ``s``. ``apply_autosp`` then rewrites the captured FX
graph (P = ranks per sequence group, r = this rank's place in it):

1. the tagged inputs are sliced to ``[r * (s // P), (r + 1) * (s // P))`` along dim 1 by nodes computed from the
   symbol, so one graph serves every length (``sp_graph.shard_tensor_node``);
2. every use of ``s`` in nodes computed from the tagged inputs becomes ``s // P`` (views, reshapes of the hidden
   states); nodes not computed from them keep the whole length: an attention mask built from the whole
   attention_mask or from cache positions (Hugging Face's) covers the whole sequence, as attention needs;
3. every SDPA gets the Ulysses all-to-alls: query, key and value from ``[batch, heads, s/P, dim]`` to
   ``[batch, heads/P, s, dim]`` (each rank attends over the whole sequence for its heads), the output back.
   A mask whose query rows were computed from the sharded inputs has its rows gathered; a per-head mask keeps
   this rank's heads (after the same all-to-all as the query when its rows are sharded). A mask whose key
   dimension is sharded cannot be rebuilt and is an error;
4. shapes are propagated again through the graph's own fake mode and the graph is recompiled.

The graph must be whole (``fullgraph=True``): a graph break would cut the path from the inputs to the attention.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.fx import GraphModule, Node

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
    marked dynamic for Dynamo (``maybe_mark_dynamic``: a hint, so a model that makes the length constant gets
    AutoSP's error naming it, not a constraint violation). AutoSP's pass shards dim 1, as DeepSpeed's.
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
        torch._dynamo.maybe_mark_dynamic(tensor, seq_dim)
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


def tagged_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors marked for sharding in ``value`` (tensors, possibly in tuples, lists and dicts)."""
    if autosp_tag(value) is not None:
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tagged_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tagged_tensors(v)]
    return []


def check_inputs(value: Any, world: int) -> None:
    """Before a compiled AutoSP forward: ``value`` holds marked tensors whose sequence dimension (1, the one the
    graph pass shards) divides by ``world``; each gets that dimension marked dynamic (tags set by hand too)."""
    marked = tagged_tensors(value)
    if not marked:
        raise ValueError("AutoSP: no input marked for sequence sharding; pass the batch through "
                         "deepspeed.compile.passes.sp_compile.prepare_autosp_inputs before each forward")
    for tensor in marked:
        role, dim = autosp_tag(tensor)
        if dim != 1 or tensor.dim() < 2:
            raise ValueError(f"AutoSP shards dimension 1 of its inputs ([batch, seq, ...]); the {role} tensor "
                             f"(shape {tuple(tensor.shape)}) is marked with seq_dim={dim}")
        if tensor.shape[1] % world:
            raise ValueError(f"AutoSP: the {role} sequence length ({tensor.shape[1]}, dim 1) must be divisible by "
                             f"sequence_parallel_size ({world})")
        torch._dynamo.maybe_mark_dynamic(tensor, 1)


def _meta(node: Any) -> Any:
    if not isinstance(node, Node):
        return node
    value = node.meta.get("val")
    return value if value is not None else node.meta.get("example_value")


def _hint(size: Any) -> int:
    """The example's value of a (symbolic) size."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


# ---- the graph passes (steps 1-4 of the module docstring), run by apply_autosp ---------------------------------
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
    labels = get_label_id_node(gm) if _tagged_placeholder(gm, LABEL_ID) else None
    tagged = [n for n in (ids, labels, get_position_id_node(gm)) if n is not None]
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
    if not _tagged_placeholder(gm, LABEL_ID):  # a model may take no labels (its loss computed outside)
        logger.warning("AutoSP: no graph input is tagged %r; labels are not sharded", LABEL_ID)
        return
    shard_tensor_node(gm, get_label_id_node(gm))


def _tagged_placeholder(gm: GraphModule, tag: str) -> bool:
    return any((n.meta.get("tensor_dict") or {}).get("tag") == tag for n in gm.graph.find_nodes(op="placeholder"))


def pass_shard_position_ids(gm: GraphModule, example_inputs: Any) -> None:
    node = get_position_id_node(gm)
    if node is None:  # optional: models may derive positions themselves
        logger.warning("AutoSP: no input is tagged %r; position ids are not sharded", POSITION_ID)
        return
    shard_tensor_node(gm, node)


def _exchange_after(gm: GraphModule, node: Node, scatter: int, gather: int, group: int) -> Node:
    with gm.graph.inserting_after(node):
        return gm.graph.call_function(torch.ops.ds_autosp.all_to_all.default, (node, scatter, gather, group))


_SDPA_ARGS = ("query", "key", "value", "attn_mask")


def _sdpa_args(node: Node) -> dict[str, Any]:
    given = dict(zip(_SDPA_ARGS, node.args, strict=False))
    return given | {n: node.kwargs[n] for n in _SDPA_ARGS if n in node.kwargs}


def _set_mask(node: Node, mask: Node) -> None:
    if len(node.args) > 3:
        node.update_arg(3, mask)
    else:
        node.update_kwarg("attn_mask", mask)


def _mask_for_whole_queries(gm: GraphModule, sdpa: Node, mask: Node, key: int) -> None:
    """Rebuild ``mask`` of ``sdpa`` for the all-to-all layout: whole query rows, this rank's heads."""
    q, m = _meta(_sdpa_args(sdpa)["query"]), _meta(mask)
    if not isinstance(m, torch.Tensor) or m.dim() < 2:
        return
    sp, heads, local = sp_dp_registry.sp_size(), q.shape[1], _hint(q.shape[2])
    if _hint(m.shape[-1]) == local and local != 1:
        raise RuntimeError(f"AutoSP cannot rebuild the attention mask of {sdpa.name}: its key dimension is sharded "
                           f"along the sequence (mask shape {tuple(m.shape)}, {local} local positions); build it from "
                           "the whole sequence, e.g. from the 2-D attention_mask, which AutoSP does not shard")
    if m.dim() == 4 and m.shape[1] not in (1, heads):
        raise RuntimeError(f"AutoSP: the head dimension of the attention mask {tuple(m.shape)} of {sdpa.name} must be "
                           f"1 or the number of query heads ({heads})")
    rows_sharded = _hint(m.shape[-2]) == local and local != 1
    with gm.graph.inserting_after(mask):
        if m.dim() == 4 and m.shape[1] == heads and heads != 1:
            if rows_sharded:  # the query's own redistribution
                new = gm.graph.call_function(torch.ops.ds_autosp.all_to_all.default, (mask, 1, 2, key))
            else:
                mine = heads // sp * (dist.get_rank() % sp)
                new = gm.graph.call_function(operator.getitem, (mask, (slice(None), slice(mine, mine + heads // sp))))
        elif rows_sharded:
            new = gm.graph.call_function(torch.ops.ds_autosp.all_gather.default, (mask, m.dim() - 2, key))
        else:
            return
    _set_mask(sdpa, new)


def pass_insert_attention_all_to_all(gm: GraphModule, example_inputs: Any) -> None:
    """Query, key and value of every SDPA go from ``[b, heads, s/P, d]`` to ``[b, heads/P, s, d]``, its output back;
    masks are rebuilt for that layout."""
    nodes = get_sdpa_nodes(gm)
    if not nodes:
        raise RuntimeError("AutoSP found no torch.nn.functional.scaled_dot_product_attention in the compiled graph; "
                           "AutoSP supports SDPA attention only")
    _propagate(gm, drop_masks=True)  # the sharded shapes, before any attention sees a whole-length mask
    sp = sp_dp_registry.sp_size()
    key = _all_to_all.register_group(sp_dp_registry.get_group(dist.get_rank() // sp))
    for node in nodes:
        given = _sdpa_args(node)
        for name in _SDPA_ARGS[:3]:
            value = _meta(given.get(name))
            if not isinstance(value, torch.Tensor) or value.dim() != 4 or value.shape[1] % sp:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                raise RuntimeError(f"AutoSP: SDPA {name} of {node.name} must be [batch, heads, seq, head_dim] with "
                                   f"heads divisible by the sequence parallel size ({sp}), got {shape}")
        if isinstance(given.get("attn_mask"), Node):
            _mask_for_whole_queries(gm, node, given["attn_mask"], key)
        for source in dict.fromkeys(given[n] for n in _SDPA_ARGS[:3]):  # a tensor used twice is exchanged once
            node.replace_input_with(source, _exchange_after(gm, source, 1, 2, key))
        users = list(node.users)
        out = _exchange_after(gm, node, 2, 1, key)
        for user in users:
            user.replace_input_with(node, out)


def _propagate(gm: GraphModule, drop_masks: bool = False) -> None:
    """Recompute every node's fake value from the graph's own fake inputs (same shape environment); with
    ``drop_masks`` attention runs without its mask meanwhile (masks and queries may not agree yet)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [_meta(n) for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = next((v.fake_mode for v in inputs if isinstance(v, torch._subclasses.FakeTensor)), None)
    if fake_mode is None:
        raise RuntimeError("AutoSP: the captured graph carries no fake input values to propagate shapes from")
    masks = {n: _sdpa_args(n).get("attn_mask") for n in get_sdpa_nodes(gm)} if drop_masks else {}
    masks = {n: m for n, m in masks.items() if m is not None}
    for node in masks:
        _set_mask(node, None)
    try:  # a caller's saved-tensor hooks must not see fake tensors: identity hooks shadow them meanwhile
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)
    finally:
        for node, mask in masks.items():
            _set_mask(node, mask)
    for node in gm.graph.nodes:
        if "val" in node.meta and "example_value" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def pass_propagate_shapes(gm: GraphModule, example_inputs: Any) -> None:
    # attention's output shape does not depend on its mask, while SDPA's fake kernel may guard on the mask: masks
    # sit out the propagation, as in DeepSpeed. A value read with .item() (a module's float attribute Dynamo did not
    # specialize) cannot be guarded on outside Dynamo's trace: then the metadata stays as captured, which is all the
    # compilers after this pass need (AOT autograd traces the graph again from the real inputs)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        _propagate(gm, drop_masks=True)
    except GuardOnDataDependentSymNode as exc:
        logger.debug("AutoSP: shape propagation skipped (%s)", str(exc).splitlines()[0])


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
