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

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.overrides import TorchFunctionMode

from deepspeed.compile import all_to_all as _all_to_all

INPUT_ID, LABEL_ID, POSITION_ID = "input_id", "label_id", "position_id"  # DeepSpeed's tags
_SHARDED_TAGS = (INPUT_ID, LABEL_ID, POSITION_ID)


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None, seq_dim: int = 1) -> tuple:
    """Mark the tensors AutoSP splits along the sequence (``seq_dim``): ``input_id``, ``label_id`` and, if given,
    ``position_id``. Returns ``(input_id, label_id, position_id, attention_mask)``; the attention mask is checked
    but stays whole (its key dimension must cover the full sequence)."""
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
    for tag, tensor in ((INPUT_ID, input_id), (LABEL_ID, label_id), (POSITION_ID, position_id)):
        if tensor is not None:
            tensor.tag = (tag, seq_dim)  # DeepSpeed's marker: (role, sequence dimension)
    return input_id, label_id, position_id, attention_mask


def autosp_tag(value: Any) -> tuple[str, int] | None:
    """``(role, seq_dim)`` of a tensor marked by ``prepare_autosp_inputs`` for sharding, else None."""
    tag = getattr(value, "tag", None) if isinstance(value, torch.Tensor) else None
    if isinstance(tag, tuple) and len(tag) == 2 and tag[0] in _SHARDED_TAGS:
        return tag
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
def sdpa_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention]


def _meta(node: Any) -> Any:
    if not isinstance(node, Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def _is_exchange(node: Any) -> bool:
    return isinstance(node, Node) and node.target is torch.ops.ds_autosp.all_to_all.default


def autosp_pass(gm: GraphModule, group: int) -> GraphModule:
    """Check the captured graph: it has SDPA, and every SDPA runs between the Ulysses all-to-alls over ``group``;
    an SDPA that could not be wrapped raises the reason."""
    nodes = sdpa_nodes(gm)
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
