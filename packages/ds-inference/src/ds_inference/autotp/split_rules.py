"""How a layer built by hand (DeepSpeed's ``LinearLayer(module, mp_group)``, ``SubParamLinearLayer(..., shape=)``)
splits its weight, and how a split of a *logical* view of the weight maps onto the physical tensor.

``split_sizes`` is DeepSpeed's ``get_shard_size_list`` rule: whole key/value heads for attention widths when the
head count is known, else multiples of ``tp_grain_size`` (the remainder on the last rank), near-even when
smaller than one grain (trailing ranks may get nothing). The model facts it reads (head counts, grain) are
process-wide state in DeepSpeed (``deepspeed.module_inject.tp_shard``); that module installs itself as the source
through :func:`set_model_facts_source`, so this package never imports ``deepspeed``.

A fused weight packs sub-parameters (Q, K, V; gate, up) along one dimension of a logical view
(``shape=((q, k, v), -1)`` views ``[q+k+v, in]``): each sub-parameter is cut on its own, ``widths[i][r]`` being
rank ``r``'s share of sub-parameter ``i``, and a rank's shard concatenates its pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds_inference.autotp.sharding import ShardLayout


@dataclass(frozen=True)
class ModelFacts:
    """The model facts the split depends on (DeepSpeed's ``tp_shard`` globals)."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1


_facts_source: Callable[[], ModelFacts] = ModelFacts


def set_model_facts_source(source: Callable[[], ModelFacts]) -> None:
    """Install the callable that returns the current :class:`ModelFacts` (read at every split)."""
    global _facts_source
    _facts_source = source


def model_facts() -> ModelFacts:
    return _facts_source()


_LAST_LINEAR = ("lm_head", "embed_out")
_MOE_MLP = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def splits_by_heads(name: object) -> bool:
    """DeepSpeed's test of a layer name: MLP, MoE-expert and output-head widths are not split by heads."""
    text = str(name)
    moe_mlp = name is not None and any(s in text for s in _MOE_MLP)
    return "mlp" not in text and text not in _LAST_LINEAR and not moe_mlp


def rank_size(total: int, tp: int, rank: int, name: object = None, num_kv_heads: int | None = None,
              facts: ModelFacts | None = None) -> int:
    """Elements of a ``total``-long dimension on tensor-parallel rank ``rank``; ``num_kv_heads`` overrides
    the facts' head count."""
    facts = facts or model_facts()
    heads = facts.num_kv_heads if num_kv_heads is None else num_kv_heads
    if heads is not None and total % heads == 0 and splits_by_heads(name):
        return total * (heads // tp + (1 if rank < heads % tp else 0)) // heads
    grain = facts.tp_grain_size
    if total >= grain:
        grains, remainder = divmod(total, grain)
        size = (grains // tp + (1 if rank < grains % tp else 0)) * grain
        return size + remainder if rank == tp - 1 else size
    return total // tp + (1 if rank < total % tp else 0)


def split_sizes(total: int, tp: int, name: object = None, num_kv_heads: int | None = None) -> list[int]:
    """Per-rank sizes of a ``total``-long dimension over ``tp`` ranks (sums to ``total``)."""
    if tp < 1:
        raise ValueError(f"split_sizes: tp={tp}; accepted: a positive number of ranks")
    facts = model_facts()
    return [rank_size(total, tp, r, name, num_kv_heads, facts) for r in range(tp)]


def subparam_widths(sizes: Sequence[int], tp: int, name: object = None) -> list[list[int]]:
    """``widths[i][r]``: rank ``r``'s share of sub-parameter ``i`` (zero where there are fewer heads than ranks)."""
    return [split_sizes(int(size), tp, name) for size in sizes]


def check_widths(sizes: Sequence[int], widths: Sequence[Sequence[int]], tp: int, what: str) -> None:
    """One width per sub-parameter and rank, each sub-parameter's widths summing to its size."""
    if len(widths) != len(sizes):
        raise ValueError(f"{what}: {len(widths)} shard-width entries for {len(sizes)} sub-parameters")
    for size, per_rank in zip(sizes, widths, strict=True):
        if len(per_rank) != tp or sum(per_rank) != size or min(per_rank) < 0:
            raise ValueError(f"{what}: shard widths {list(per_rank)} for a sub-parameter of size {size}; accepted: "
                             f"{tp} non-negative widths (one per rank) summing to {size}")


def logical_layout(logical: Sequence[int], out_ndim: int, dim: int, sizes: Sequence[int],
                   widths: Sequence[Sequence[int]]) -> tuple[int, ShardLayout]:
    """(physical dimension, layout) of splitting dimension ``dim`` of the ``logical`` view, where the physical
    tensor is ``[prod(logical[:out_ndim]), prod(logical[out_ndim:])]`` (a weight: ``out_ndim = len - 1``; a
    bias: ``out_ndim = len``, physically 1-D). Each of the rank's pieces becomes one contiguous range per index
    of the dimensions before ``dim`` (row-major), in the order the logical cut concatenates them."""
    if not 0 <= dim < len(logical):
        raise ValueError(f"partition_dim {dim} is out of range for the logical shape {tuple(logical)}")
    start, stop = (0, out_ndim) if dim < out_ndim else (out_ndim, len(logical))
    prefix, stride = math.prod(logical[start:dim]), math.prod(logical[dim + 1:stop])
    full = math.prod(logical[start:stop])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    tp = len(widths[0]) if widths else 1
    pieces = []
    for rank in range(tp):
        ranges = []
        for pre in range(prefix):
            for begin, per_rank in zip(starts, widths, strict=True):
                offset = begin + sum(per_rank[:rank])
                ranges.append((pre * logical[dim] * stride + offset * stride, per_rank[rank] * stride))
        pieces.append(tuple(ranges))
    return (0 if dim < out_ndim else 1), ShardLayout(full=full, pieces=tuple(pieces))


def layout_widths(layout: ShardLayout) -> tuple[tuple[int, ...], list[list[int]]] | None:
    """(sub-parameter sizes, ``widths[i][r]``) when every rank holds one piece of each sub-parameter and the
    pieces tile each sub-parameter in rank order; None for any other layout."""
    count = len(layout.pieces[0])
    if any(len(ranks) != count for ranks in layout.pieces):
        return None
    sizes, widths, begin = [], [], 0
    for i in range(count):
        cursor = begin
        for ranks in layout.pieces:
            start, length = ranks[i]
            if start != cursor and length:
                return None
            cursor += length
        widths.append([ranks[i][1] for ranks in layout.pieces])
        sizes.append(cursor - begin)
        begin = cursor
    return (tuple(sizes), widths) if begin == layout.full else None
