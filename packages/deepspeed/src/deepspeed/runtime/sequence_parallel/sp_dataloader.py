"""ALST's data loader adapter: ``UlyssesSPDataLoaderAdapter`` shards every batch's sequence over the SP group.

Each rank of a sequence-parallel group draws its own batch from the wrapped loader. On a refill the ranks exchange
their batches, and then the group works through them one after the other: on the i-th step every rank holds its
slice of rank i's batch (slice r of ``P`` equal slices of dim 1 for rank r). So one pass of ``P`` steps consumes
``P`` batches, as ``P`` data-parallel ranks would, but each batch is computed by the whole group.

Labels are shifted before slicing (``shift_labels[t] = labels[t + 1]``, -100 after the last token) because the
next token of a slice's last position lives on the next rank; ``labels`` is removed so that models do not compute
a loss from unshifted labels, and the caller computes it from ``shift_labels``. Non-tensor entries are passed on
whole. ``position_ids`` are required: sliced with the inputs they keep every token's global position.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["UlyssesSPDataLoaderAdapter"]

_IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` (any iterable of dict batches with tensors ``[bs, seqlen, ...]``, including ``input_ids``,
    ``position_ids`` and ``labels``); iterating yields this rank's slice of each group member's batch in turn
    (see the module docstring). ``device``: where the exchange runs (the slices are returned on the CPU, as
    DeepSpeed does, to keep long prefill buffers off the accelerator). ``len()`` is ``len(dl) * sp_world_size``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        if sp_world_size != dist.get_world_size(sp_group) or not 0 <= sp_rank < sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_rank={sp_rank}, sp_world_size={sp_world_size} do not "
                             f"describe sp_group (size {dist.get_world_size(sp_group)})")
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw one batch here, exchange with the group, queue this rank's slices of every member's batch."""
        try:
            batch = next(self.iter)
        except StopIteration:
            batch = None
        layouts = self._exchange_layouts(batch)
        if all(layout is None for layout in layouts):
            self.iter = iter(self.dl)  # the next epoch starts afresh, as a DataLoader does
            raise StopIteration
        finished = [r for r, layout in enumerate(layouts) if layout is None]
        if finished:
            raise RuntimeError(f"UlyssesSPDataLoaderAdapter: the data loaders of sequence-parallel ranks {finished} "
                               f"ran out while the others still had batches; every rank of the group must draw the "
                               f"same number of batches")
        per_rank = self._exchange_batches(batch, layouts)
        for member in per_rank:
            self.micro_batches.append(self._slice(member))

    def _exchange_layouts(self, batch: dict[str, Any] | None) -> list[Any]:
        """Every rank's keys and tensor shapes (None for an exhausted loader): one small collective, so that a
        bad batch on one rank fails every rank before the tensor exchange."""
        layout = None if batch is None else _layout(batch)
        layouts: list[Any] = [None] * self.sp_world_size
        dist.all_gather_object(layouts, layout, group=self.sp_group)
        for r, lay in enumerate(layouts):
            if isinstance(lay, str):
                raise ValueError(f"UlyssesSPDataLoaderAdapter: the batch of sequence-parallel rank {r}: {lay}")
        keys = {tuple(k for k, _ in lay) for lay in layouts if lay is not None}
        if len(keys) > 1:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: the ranks' batches have different keys: {sorted(keys)}")
        return layouts

    def _exchange_batches(self, batch: dict[str, Any], layouts: list[Any]) -> list[dict[str, Any]]:
        per_rank: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, _ in layouts[self.sp_rank]:
            value = batch[key]
            if torch.is_tensor(value):
                parts = _all_gather_shaped(value.to(self.device), [dict(lay)[key] for lay in layouts], self.sp_group)
            else:
                parts = [None] * self.sp_world_size
                dist.all_gather_object(parts, value, group=self.sp_group)
            for member, part in zip(per_rank, parts, strict=True):
                member[key] = part
        return per_rank

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        seqlen = batch["input_ids"].shape[1]
        if seqlen % self.sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: a batch's sequence length ({seqlen}) is not divisible by "
                             f"the sequence parallel size ({self.sp_world_size}); pad it to a multiple")
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=_IGNORE_INDEX)[..., 1:].contiguous()
        chunk = seqlen // self.sp_world_size
        start = chunk * self.sp_rank
        return {k: v[:, start:start + chunk].cpu() if torch.is_tensor(v) else v for k, v in batch.items()}


def _layout(batch: dict[str, Any]) -> list[tuple[str, Any]] | str:
    """[(key, shape or None)], or a string saying what is wrong with the batch."""
    for key in ("input_ids", "position_ids", "labels"):
        if key not in batch or not torch.is_tensor(batch[key]):
            return (f"{key!r} is missing (the batch has {sorted(batch)}); Ulysses needs input_ids, labels and "
                    f"position_ids (torch.arange(seq_len) per sample, reset at document boundaries when packed)")
    seqlen = batch["input_ids"].shape[1] if batch["input_ids"].dim() >= 2 else None
    layout = []
    for key, value in batch.items():
        if torch.is_tensor(value):
            if value.dim() < 2 or value.shape[1] != seqlen:
                return (f"{key!r} has shape {tuple(value.shape)}; every tensor must be [bs, seqlen, ...] with the "
                        f"seqlen of input_ids {tuple(batch['input_ids'].shape)}")
            layout.append((key, (tuple(value.shape), value.dtype)))
        else:
            layout.append((key, None))
    return layout


def _all_gather_shaped(t: Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]], group: Any) -> list[Tensor]:
    """All-gather tensors whose shapes differ by rank: padded to the largest, then cut back."""
    dtypes = {dtype for _, dtype in shapes}
    if len(dtypes) > 1:
        raise ValueError(f"UlyssesSPDataLoaderAdapter: the ranks' tensors of one key have different dtypes {dtypes}")
    dims = [s for s, _ in shapes]
    if len({len(d) for d in dims}) > 1:
        raise ValueError(f"UlyssesSPDataLoaderAdapter: the ranks' tensors of one key have different ranks: {dims}")
    big = tuple(max(d[i] for d in dims) for i in range(len(dims[0])))
    padded = t.new_zeros(big)
    padded[tuple(slice(0, n) for n in t.shape)] = t
    with torch.no_grad():
        parts = [torch.empty_like(padded) for _ in dims]
        dist.all_gather(parts, padded, group=group)
    return [p[tuple(slice(0, n) for n in d)] for p, d in zip(parts, dims, strict=True)]
