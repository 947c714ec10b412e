"""Which columns ZenFlow updates every step, and the averaged gradient of those columns on every rank.

A weight of shape ``(rows, columns, *rest)`` has its columns on dim 1. At a selection boundary each weight
keeps the ``int(topk_ratio * columns)`` columns with the largest absolute gradient sum. Parameters of one
dimension (biases, norms) are taken whole every step. Under ZeRO 1/2 each rank holds one partition of the
averaged gradient of a group's flat buffer:

- The column sums come from each rank's partition and are then summed over the group's ranks (one small
  all-reduce). Every rank therefore picks the same columns.
- The selected elements are gathered every step. Each rank packs the ones its partition holds (the same
  index lists on every rank), and one all-gather gives every rank all of them, in the order of
  ``param[:, columns]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_zero.collectives import Collectives

__all__ = ["GroupSelection", "gather_selected_grads", "select_columns"]


def _shape3(param: torch.Tensor) -> tuple[int, int, int]:
    """``(rows, columns, inner)``: the weight as rows of columns of ``inner`` contiguous elements."""
    return param.shape[0], param.shape[1], math.prod(param.shape[2:])


def _add_column_sums(sums: torch.Tensor, values: torch.Tensor, start: int, columns: int, inner: int) -> None:
    """Add ``|values|`` (elements ``start ...`` of a ``(rows, columns, inner)`` weight) to their columns' sums."""
    row = columns * inner
    end = start + values.numel()
    head = min(end, -(-start // row) * row)  # whole rows in the middle go through a reshaped sum

    def partial(lo: int, hi: int) -> None:
        if hi > lo:
            cols = torch.div(torch.arange(lo, hi), inner, rounding_mode="floor") % columns
            sums.index_add_(0, cols, values[lo - start:hi - start].abs().to(sums.dtype))

    partial(start, head)
    body = (end - head) // row * row
    if body:
        sums += values[head - start:head - start + body].view(-1, columns, inner).abs().sum(dim=(0, 2)).to(sums.dtype)
    partial(head + body, end)


@dataclass
class GroupSelection:
    """The selection of one flat group: which parameters take selective steps and where their elements are."""

    params: list[torch.nn.Parameter]  # in flat order; each has ``selected_indices`` set
    counts: list[int]  # selected elements of each, concatenated in this order
    owned: list[torch.Tensor]  # per rank: positions in the concatenation that its partition holds
    local: torch.Tensor  # this rank's partition offsets of ``owned[rank]``, in that order
    width: int  # the longest ``owned`` list (all-gather slots are this wide)


def select_columns(fg, grad: torch.Tensor, topk_ratio: float, comm: Collectives) -> GroupSelection:
    """Pick the columns of every weight of flat group ``fg`` from this rank's averaged gradient partition
    ``grad`` (fp32) and the other ranks' (collective over ``fg.process_group``)."""
    layout, weights = fg.layout, [p for p in fg.params if p.dim() >= 2]
    sums = {p: torch.zeros(p.shape[1], dtype=torch.float64, device=grad.device) for p in weights}
    for frag in fg.own:
        p = fg.params[frag.index]
        if p in sums:
            _, columns, inner = _shape3(p)
            _add_column_sums(sums[p], grad.narrow(0, frag.partition_offset, frag.numel), frag.tensor_offset, columns,
                             inner)
    if weights and layout.world_size > 1:
        flat = torch.cat([sums[p] for p in weights]).to(fg.lp_flat.device)
        comm.all_reduce(flat, op=dist.ReduceOp.SUM, group=fg.process_group)
        for p, piece in zip(weights, flat.cpu().split([p.shape[1] for p in weights]), strict=True):
            sums[p] = piece
    chosen, counts, positions = [], [], []
    for index, p in enumerate(fg.params):
        base = layout.offsets[index]
        if p.dim() < 2:
            p.selected_indices = torch.arange(p.numel(), device=p.device)
            pos = torch.arange(p.numel())
        else:
            rows, columns, inner = _shape3(p)
            k = int(topk_ratio * columns)
            if k < 1:  # too few columns for the ratio: the whole weight waits for the full step
                p.selected_indices = p.selected_grad = None
                continue
            top = torch.topk(sums[p].cpu(), k).indices.sort().values
            p.selected_indices = top.to(p.device)
            pos = ((torch.arange(rows)[:, None, None] * columns + top[None, :, None]) * inner
                   + torch.arange(inner)[None, None, :]).reshape(-1)
        chosen.append(p)
        counts.append(pos.numel())
        positions.append(base + pos)
    flat = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    owner = torch.div(flat, layout.partition_numel, rounding_mode="floor")
    owned = [(owner == r).nonzero().squeeze(1) for r in range(layout.world_size)]
    start, _ = layout.partition_range(fg.rank)
    local = flat[owned[fg.rank]] - start
    return GroupSelection(chosen, counts, owned, local, max((o.numel() for o in owned), default=0))


def gather_selected_grads(sel: GroupSelection, fg, grad: torch.Tensor, comm: Collectives) -> None:
    """Set ``selected_grad`` (the averaged gradient of the selected columns, fp32) on every parameter of
    ``sel``, from each rank's gradient partition ``grad`` (collective over ``fg.process_group``)."""
    mine = grad.index_select(0, sel.local.to(grad.device))
    world = fg.layout.world_size
    if world == 1:
        full = mine
    else:
        device = fg.lp_flat.device  # the collective's device (NCCL needs the accelerator)
        slot = torch.zeros(sel.width, dtype=mine.dtype, device=device)
        slot[:mine.numel()] = mine.to(device)
        out = torch.empty(world * sel.width, dtype=mine.dtype, device=device)
        comm.all_gather_into_tensor(out, slot, group=fg.process_group)
        full = torch.empty(sum(sel.counts), dtype=mine.dtype, device=device)
        for r, positions in enumerate(sel.owned):
            full[positions.to(device)] = out[r * sel.width:r * sel.width + positions.numel()]
    for p, piece in zip(sel.params, full.split(sel.counts), strict=True):
        shape = (p.shape[0], p.selected_indices.numel(), *p.shape[2:]) if p.dim() >= 2 else p.shape
        p.selected_grad = piece.view(shape).to(p.device)
