"""Muon under ZeRO: the orthogonalised update computed on each weight's full, data-parallel averaged gradient.

Muon's update of a weight matrix depends on the whole matrix (Newton-Schulz mixes every row with every other),
so it cannot run on the flat slices a ZeRO rank owns; orthogonalising a slice gives a different, wrong update
(DeepSpeed issue 7807). At each step, after the gradients are averaged, unscaled and clipped, for every Muon
parameter group (``use_muon`` of ds-ops' ``MuonWithAuxAdam``) :class:`ZeroMuon`:

1. all-gathers the group's gradient partitions and its momentum partitions into full flat buffers (two
   all-gathers over the group's ranks; temporary, the size of the group's full fp32 flat vector each);
2. computes ``muon_update`` of some of the weights, so that each rank orthogonalises about ``1/W`` of them:
   ZeRO-1/2, every weight with a piece in this rank's partition (a weight spanning two partitions is computed by
   both ranks from the same inputs, so both keep the same momentum); ZeRO-3, where every rank holds a piece of
   nearly every weight, weights ``r, r + W, ...`` on rank ``r``;
3. keeps this rank's pieces of the updates as its gradient partition and of the new momentum as its momentum
   partition (the optimizer state ``momentum_buffer``, shaped like the fp32 master partition, so checkpoints save
   and re-partition it like any elementwise state). ZeRO-3 hands each rank its pieces of the weights others
   computed with one reduce-scatter each for updates and momentum (every element comes from one rank, the
   others add zeros: exact).

The optimizer then applies the partition's gradient as the finished update (``ORTHOGONALIZED`` groups).
Gradient clipping therefore acts on the gradients (as ``clip_grad_norm_`` before ``torch.optim.Muon`` does),
and the loss scale is removed before Newton-Schulz sees them; overflowing steps are skipped before any
momentum changes. Auxiliary-Adam groups are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_ops.muon import ORTHOGONALIZED, is_muon_optimizer, muon_update
from ds_zero.collectives import Collectives
from ds_zero.gather import gather_partitions


class _FlatView:
    """ZeRO-1/2: a group's parameters back to back in one padded flat buffer cut into equal partitions."""

    def __init__(self, fg: Any, comm: Collectives, method: str, chunk: int) -> None:
        self.fg, self.comm, self.method, self.chunk = fg, comm, method, chunk
        self.indices = sorted({frag.index for frag in fg.own})
        self.params = fg.params
        self.device = fg.grad_device

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        layout = self.fg.layout
        flat = torch.zeros(layout.padded_numel, dtype=torch.float32, device=self.device)
        start, end = layout.partition_range(self.fg.rank)
        flat[start:end].copy_(part)
        gather_partitions(self.comm, flat, layout, self.fg.rank, self.fg.process_group, self.method, self.chunk)
        return flat

    def read(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        offset, p = self.fg.layout.offsets[j], self.params[j]
        return flat.narrow(0, offset, p.numel()).view(p.shape)

    def begin(self) -> torch.Tensor:
        return torch.zeros(self.fg.layout.partition_numel, dtype=torch.float32, device=self.device)

    def store(self, out: torch.Tensor, j: int, value: torch.Tensor) -> None:
        src = value.reshape(-1)
        for frag in self.fg.own:
            if frag.index == j:
                out.narrow(0, frag.partition_offset, frag.numel).copy_(src.narrow(0, frag.tensor_offset, frag.numel))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out


class _Stage3View:
    """ZeRO-3: each parameter cut into ``world`` equal pieces; a rank's pieces sit back to back in its flat
    partition, at the same offsets on every rank."""

    def __init__(self, group: Any, comm: Collectives, dp_group: Any, world: int, rank: int) -> None:
        self.g, self.comm, self.dp_group, self.world, self.rank = group, comm, dp_group, world, rank
        self.params = group.params
        self.indices = list(range(rank, len(self.params), world))  # round-robin: each weight on one rank
        self.device = group.grad_device

    def _piece(self, j: int, rank: int) -> tuple[int, int]:
        """(start in the whole parameter, numel) of rank ``rank``'s piece of parameter ``j``."""
        p = self.params[j]
        size = p.ds_tensor.numel()
        start = rank * size
        return start, max(0, min(size, p.ds_numel - start))

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        part = part.to(self.device, torch.float32)
        if self.world == 1:
            return part.view(1, -1)
        out = torch.empty(self.world * part.numel(), dtype=part.dtype, device=part.device)
        self.comm.all_gather_into_tensor(out, part.contiguous(), group=self.dp_group)
        return out.view(self.world, -1)

    def read(self, gathered: torch.Tensor, j: int) -> torch.Tensor:
        p = self.params[j]
        offset, size = self.g.offsets[j], p.ds_tensor.numel()
        return gathered[:, offset:offset + size].reshape(-1)[:p.ds_numel].view(p.ds_shape)

    def begin(self) -> torch.Tensor:
        return torch.zeros(self.world, self.g.numel, dtype=torch.float32, device=self.device)

    def store(self, out: torch.Tensor, j: int, value: torch.Tensor) -> None:
        """Every rank's piece of weight ``j`` into its row of ``out`` (the weight's other rows stay zero)."""
        src = value.reshape(-1)
        for rank in range(self.world):
            start, numel = self._piece(j, rank)
            out[rank].narrow(0, self.g.offsets[j], numel).copy_(src.narrow(0, start, numel))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """Row ``r`` summed over the ranks, to rank ``r``: exact, since one rank wrote each element and the others
        hold zeros there."""
        if self.world == 1:
            return out[0]
        mine = torch.empty(self.g.numel, dtype=out.dtype, device=out.device)
        scatter = getattr(self.comm, "reduce_scatter_tensor", None) or dist.reduce_scatter_tensor
        scatter(mine, out.reshape(-1), group=self.dp_group)
        return mine


class ZeroMuon:
    """The Muon step of a ZeRO optimizer wrapper: ``apply(grads)`` rewrites the gradient partitions of its Muon
    groups into Muon's updates (a collective: every rank of each group calls it at every step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, views: list[tuple[torch.Tensor, Any]]) -> None:
        """``views``: (fp32 master partition, view) per flat (sub-)group, aligned with the wrapper's groups."""
        self.optimizer = optimizer
        self.views = views
        self.group_of = {id(m): pg for pg in optimizer.param_groups for m in pg["params"]}
        for pg in optimizer.param_groups:
            if pg.get("use_muon"):
                pg[ORTHOGONALIZED] = True

    @staticmethod
    def wanted(optimizer: torch.optim.Optimizer) -> bool:
        return is_muon_optimizer(optimizer) and any(pg.get("use_muon") for pg in optimizer.param_groups)

    @classmethod
    def for_stage12(cls, wrapper: Any) -> ZeroMuon | None:
        if not cls.wanted(wrapper.optimizer):
            return None
        views = [(fg.master, _FlatView(fg, wrapper.comm, method, wrapper.settings.allgather_bucket_numel))
                 for fg, method in zip(wrapper.groups, wrapper._gather, strict=True)]
        return cls(wrapper.optimizer, views)

    @classmethod
    def for_stage3(cls, wrapper: Any) -> ZeroMuon | None:
        if not cls.wanted(wrapper.optimizer):
            return None
        if wrapper.swapper is not None:
            raise ValueError("zero_optimization.offload_optimizer.device=nvme: the Muon optimizer is not available "
                             "with NVMe optimizer offload in this version; accepted with Muon: none or cpu")
        views = [(g.master, _Stage3View(g, wrapper.comm, wrapper.dp_group, wrapper.world, wrapper.rank))
                 for g in wrapper.groups]
        return cls(wrapper.optimizer, views)

    def momentum(self, master: torch.Tensor) -> torch.Tensor:
        state = self.optimizer.state[master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(master, dtype=torch.float32)
        return state["momentum_buffer"]

    @torch.no_grad()
    def apply(self, grads: list[torch.Tensor]) -> None:
        """``grads``: each (sub-)group's unscaled, clipped fp32 gradient partition; Muon groups' are rewritten."""
        for (master, view), grad in zip(self.views, grads, strict=True):
            group = self.group_of.get(id(master))
            if group is None or not group.get("use_muon"):
                continue
            mom = self.momentum(master)
            full_grad, full_mom = view.gather(grad), view.gather(mom)
            new_grad, new_mom = view.begin(), view.begin()  # padding stays zero
            for j in view.indices:
                m = view.read(full_mom, j).clone()
                update = muon_update(view.read(full_grad, j), m, beta=group["momentum"],
                                     ns_method=group["ns_method"],
                                     is_expert_group=getattr(view.params[j], "is_expert_group", False))
                view.store(new_grad, j, update)
                view.store(new_mom, j, m)
            grad.copy_(view.finish(new_grad))
            mom.copy_(view.finish(new_mom))
