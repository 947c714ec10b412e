"""Routed assignments split over tensor-parallel peers and put back (DeepSpeed's ``deepspeed.moe.ep_tp_dispatch``),
for AutoEP folded onto AutoTP.

Every TP peer routes the same tokens to the same experts. Rather than send ``tp_size`` copies of each assignment
through the expert all-to-all, peer ``r`` keeps the assignments whose ordinal within their expert is ``r`` modulo
``tp_size`` (:func:`partition_assignments`). After the experts ran, :func:`restore_combined` all-gathers the
peers' expert outputs (rows of variable count) and combines them per token in top-k slot order, so every peer
holds the same output as the unpartitioned combine, bit for bit.

Gradients: the gather's backward sums the peers' output gradients over the TP group before keeping this peer's
rows (each peer's loss reaches every row), so with identical losses an expert row gets ``tp_size`` times its
gradient (``expert_tp_cancel`` in ``ds_moe.autoep.folding``). The combine weights are taken from the full,
replicated payload, so their gradient on each peer is that peer's loss gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RestoreContext", "RoutedAssignmentPayload", "assert_tp_payload_consistent", "assignment_ordinals_by_expert",
           "dispatch_counters", "partition_assignments", "restore_combined"]

# the integer fields compared across TP peers, in this order (their digests are all-reduced with MIN and MAX)
_DIGEST_FIELDS = ("token_indices", "expert_indices", "assignment_indices", "capacity_slots", "drop_mask", "pad_mask")
_DIGEST_PRIME = 2_147_483_629  # below 2**31: products with small multipliers stay exact in int64


@dataclass
class RoutedAssignmentPayload:
    """One row per routed (token, expert) assignment, rows grouped by expert. ``capacity_slots``: the assignment's
    top-k slot (the order tokens' outputs are summed in); ``input_splits``: rows per destination EP rank;
    ``extra``: ``destination_ranks`` (per row) and ``num_tokens`` (the tokens being routed)."""

    token_indices: Tensor
    expert_indices: Tensor
    assignment_indices: Tensor
    capacity_slots: Tensor
    combine_weights: Tensor
    drop_mask: Tensor
    pad_mask: Tensor
    input_splits: list[int]
    output_splits: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RestoreContext:
    """What :func:`restore_combined` needs: the full payload and the rows (``local_indices``) this peer kept."""

    original_payload: RoutedAssignmentPayload
    local_indices: Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict[str, int]


def assignment_ordinals_by_expert(expert_indices: Tensor) -> Tensor:
    """Each row's position inside its run of equal consecutive expert ids:
    ``[0, 0, 2, 2, 2, 4] -> [0, 1, 0, 1, 2, 0]``."""
    n = expert_indices.numel()
    positions = torch.arange(n, device=expert_indices.device, dtype=torch.long)
    if n == 0:
        return positions
    starts_run = torch.ones(n, dtype=torch.bool, device=expert_indices.device)
    starts_run[1:] = expert_indices[1:] != expert_indices[:-1]
    run_start = torch.where(starts_run, positions, torch.zeros_like(positions)).cummax(dim=0).values
    return positions - run_start


def _rows(payload: RoutedAssignmentPayload, index: Tensor) -> RoutedAssignmentPayload:
    """The payload's rows ``index`` (per-row ``extra`` tensors too; splits recounted from the destinations)."""
    n = payload.token_indices.shape[0]
    extra = {key: value.index_select(0, index) if isinstance(value, Tensor) and value.dim() > 0
             and value.shape[0] == n else value for key, value in payload.extra.items()}
    taken = replace(payload, extra=extra, input_splits=list(payload.input_splits),
                    output_splits=list(payload.output_splits),
                    **{name: getattr(payload, name).index_select(0, index) for name in
                       ("token_indices", "expert_indices", "assignment_indices", "capacity_slots",
                        "combine_weights", "drop_mask", "pad_mask")})
    destinations = extra.get("destination_ranks")
    if isinstance(destinations, Tensor) and payload.input_splits:
        counts = torch.bincount(destinations.long(), minlength=len(payload.input_splits))
        taken.input_splits = [int(c) for c in counts[:len(payload.input_splits)].tolist()]
        taken.output_splits = list(taken.input_splits)
    return taken


def _num_tokens(payload: RoutedAssignmentPayload) -> int:
    value = payload.extra.get("num_tokens")
    if value is None:
        return int(payload.token_indices.max().item()) + 1 if payload.token_indices.numel() else 0
    return int(value.item()) if isinstance(value, Tensor) else int(value)


def partition_assignments(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_rank: int,
                          tp_size: int) -> tuple[RoutedAssignmentPayload, RestoreContext]:
    """This peer's share of the live (not dropped, not padded) assignments, and the context to restore them.
    ``tp_group`` is not used here (the split is computed identically on every peer)."""
    if not 0 <= tp_rank < max(tp_size, 1):
        raise ValueError(f"partition_assignments: tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    live = ~(payload.drop_mask | payload.pad_mask)
    keep = live if tp_size <= 1 else live & (payload.assignment_indices.remainder(tp_size) == tp_rank)
    local_indices = keep.nonzero().flatten()
    local = _rows(payload, local_indices)
    counters = {"assignments_total": int(live.sum()), "assignments_local": int(local_indices.numel()),
                "padded": int(payload.pad_mask.sum()), "dropped": int(payload.drop_mask.sum()),
                "split_sum_in": sum(local.input_splits), "split_sum_out": sum(local.output_splits)}
    ctx = RestoreContext(payload, local_indices, tp_rank, tp_size, _num_tokens(payload), counters)
    return local, ctx


def dispatch_counters(ctx: RestoreContext) -> dict[str, int]:
    """Assignment counts of one partition: ``assignments_total`` / ``assignments_local`` / ``padded`` /
    ``dropped`` / ``split_sum_in`` / ``split_sum_out``."""
    return dict(ctx.counters)


class _GatherRows(torch.autograd.Function):
    """All-gather of row blocks of different lengths over ``group``; backward sums the gradient over the group
    and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, group: Any, counts: list[int], rank: int) -> Tensor:
        ctx.group, ctx.counts, ctx.rank = group, counts, rank
        return _gather_rows(rows, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[:ctx.rank])
        return grad[start:start + ctx.counts[ctx.rank]], None, None, None


def _gather_rows(rows: Tensor, group: Any, counts: list[int]) -> Tensor:
    """Concatenate every rank's ``rows`` (``counts[r]`` rows on rank ``r``) in rank order; padded to the longest
    block for ``all_gather``."""
    longest = max(counts)
    padded = rows.new_zeros((longest, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows.detach()
    blocks = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([block[:count] for block, count in zip(blocks, counts, strict=True)])


def _row_counts(n: int, group: Any, device: torch.device) -> list[int]:
    size = dist.get_world_size(group=group)
    mine = torch.tensor([n], dtype=torch.long, device=device)
    every = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    return [int(c.item()) for c in every]


def _check_coverage(payload: RoutedAssignmentPayload, rows: Tensor) -> None:
    """``RuntimeError`` unless ``rows`` (payload row numbers gathered from the peers) are every live row once."""
    live = (~(payload.drop_mask | payload.pad_mask)).nonzero().flatten()
    got = torch.sort(rows.long()).values
    if got.numel() != live.numel() or not torch.equal(got.cpu(), live.cpu()):
        missing = sorted(set(live.tolist()) - set(got.tolist()))[:5]
        unexpected = sorted(set(got.tolist()) - set(live.tolist()))[:5]
        raise RuntimeError(f"AutoEP+AutoTP restore coverage mismatch: gathered {got.numel()} assignment rows, "
                           f"expected {live.numel()}; missing rows {missing}, unexpected or repeated rows "
                           f"{unexpected}")


def restore_combined(local_combined: Tensor, ctx: RestoreContext, *, tp_group: Any,
                     validate_coverage: bool = False) -> Tensor:
    """``[num_tokens, ...]``: every peer's expert outputs (``local_combined``, rows in ``ctx.local_indices``
    order) weighted by the combine weights and summed per token in top-k slot order; the same on every peer.
    ``validate_coverage``: first check that the peers' rows are each live assignment exactly once."""
    payload = ctx.original_payload
    rows_index = ctx.local_indices
    values = local_combined
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(group=tp_group) > 1:
        counts = _row_counts(rows_index.numel(), tp_group, rows_index.device)
        rank = dist.get_rank(group=tp_group)
        rows_index = _gather_rows(rows_index, tp_group, counts)
        values = _GatherRows.apply(local_combined, tp_group, counts, rank)
    if validate_coverage:
        _check_coverage(payload, rows_index)
    tokens = payload.token_indices.index_select(0, rows_index).long()
    slots = payload.capacity_slots.index_select(0, rows_index).long()
    weights = payload.combine_weights.index_select(0, rows_index).float()
    width = int(slots.max().item()) + 1 if slots.numel() else 1
    trailing = local_combined.shape[1:]
    # a [token, slot] grid summed over slots: the same additions, in the same order, as the unpartitioned combine
    grid = values.new_zeros((ctx.num_tokens * width, *trailing), dtype=torch.float32)
    scaled = values.float() * weights.reshape(-1, *([1] * len(trailing)))
    grid = grid.index_put((tokens * width + slots,), scaled)
    out = grid.reshape(ctx.num_tokens, width, *trailing).sum(dim=1)
    return out.to(local_combined.dtype)


def _digest(payload: RoutedAssignmentPayload) -> Tensor:
    """Two position-weighted checksums per integer field, plus the row count: equal payloads give equal digests
    (a differing value shifts both sums)."""
    words = [torch.tensor([payload.token_indices.numel()], dtype=torch.long)]
    for name in _DIGEST_FIELDS:
        values = getattr(payload, name).detach().reshape(-1).long().cpu() % _DIGEST_PRIME
        weights = torch.arange(1, values.numel() + 1, dtype=torch.long) % _DIGEST_PRIME
        words.append(torch.stack([values.sum() % _DIGEST_PRIME, (values * weights % _DIGEST_PRIME).sum() %
                                  _DIGEST_PRIME]))
    return torch.cat(words)


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_size: int) -> None:
    """``RuntimeError`` when the TP peers routed differently (folding needs identical routing on every peer);
    two small all-reduces (MIN, MAX) of a digest. Nothing to check alone or without torch.distributed."""
    if tp_size <= 1 or not dist.is_initialized():
        return
    digest = _digest(payload)
    device = payload.token_indices.device
    low, high = digest.clone().to(device), digest.clone().to(device)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
    if not torch.equal(low, high):
        differing = [name for i, name in enumerate(("row_count",) + _DIGEST_FIELDS)
                     if not torch.equal(low[_span(i)], high[_span(i)])]
        raise RuntimeError(f"AutoEP+AutoTP routing decisions differ across tensor-parallel lanes (fields "
                           f"{differing}): folded dispatch needs the same routed assignments on every TP peer "
                           "(identical inputs and router weights on the TP group)")


def _span(i: int) -> slice:
    return slice(0, 1) if i == 0 else slice(1 + 2 * (i - 1), 3 + 2 * (i - 1))
