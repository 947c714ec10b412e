"""``PartitionedTensor`` (``deepspeed.runtime.utils``): one tensor split evenly over a process group, each rank
holding a flat slice; the pipeline engine uses it to send activations as a small metadata tensor plus this rank's
slice, and ``full()`` gathers the whole tensor back.

Metadata layout (``to_meta``/``from_meta``, a LongTensor, DeepSpeed's so peers running either implementation can
exchange it): ``[ndim, *shape, num_parts, rank, *boundaries]`` where ``boundaries`` are the ``num_parts + 1`` flat
offsets of the slices (``partition_uniform``: the first ``numel % num_parts`` slices one element longer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ds_pipe.module import partition_uniform


class PartitionedTensor:
    """This rank's slice of ``tensor`` (flattened) over ``group``; ``full()`` is collective over ``group``."""

    def __init__(self, tensor: torch.Tensor, group: Any, partition_meta: Any = None) -> None:
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, end = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:end].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Any = None) -> PartitionedTensor:
        """Rebuild from a peer's ``to_meta()`` and this rank's slice (as received)."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a torch.long tensor, got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        shape, rest = values[1:1 + ndim], values[1 + ndim:]
        obj = cls.__new__(cls)
        obj.group = group
        obj.num_parts = dist.get_world_size(group=group)
        obj.rank = dist.get_rank(group=group)
        if rest[:2] != [obj.num_parts, obj.rank]:
            raise ValueError(f"PartitionedTensor.from_meta: meta was made for {rest[0]} parts at rank {rest[1]}; "
                             f"this group has {obj.num_parts} parts and this is rank {obj.rank}")
        obj.orig_size = shape
        obj.orig_device = local_part.device if device is None else torch.device(device)
        obj.partition = rest[2:]
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(shape) % obj.num_parts == 0
        return obj

    def to_meta(self) -> torch.Tensor:
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor on every rank (collective over the group)."""
        device = self.orig_device if device is None else device
        flat = torch.zeros(math.prod(self.orig_size), dtype=self.local_data.dtype, device=device)
        if self.even_split:
            dist.all_gather_into_tensor(flat, self.local_data.to(device), group=self.group)
        else:  # uneven slices: each owner broadcasts its own
            for part in range(self.num_parts):
                start, end = self.partition[part], self.partition[part + 1]
                view = flat[start:end]
                if part == self.rank:
                    view.copy_(self.local_data)
                dist.broadcast(view, dist.get_global_rank(self.group, part) if self.group is not None else part,
                               group=self.group)
        return flat.view(self.orig_size).clone()

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
