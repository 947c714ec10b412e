"""ZeRO-3 parameter gathers with MiCS and ZeRO++ (one exchange per batch of parameters, as ``zero3._collectives``):

- qwZ (``quantize``): each rank's packed partitions are int8-quantized blockwise before the all-gather and every
  received chunk (this rank's too, so all ranks hold the same values) is dequantized on arrival;
- hpZ (``secondary``): a gather from the primary partitions (forward) keeps this rank's slice of the whole value
  for its secondary group (``ceil(numel / H)`` elements, ``param.ds_secondary``); a gather during backward
  comes from those secondary slices, inside the small group (intra-node);
- ``zero_quantized_nontrainable_weights``: partitions stored int8 (``ds_zero.zeropp.frozen``) travel as stored;
- MiCS hierarchical gather (``hierarchy``): the shard group's chunks are gathered first across nodes (ranks at
  the same place on every node), then the gathered block within the node; the chunks are put back in rank order.

Whether a gather runs in backward is read from autograd (a backward pass is executing on this thread); every
rank runs the same passes, so all ranks pick the same source. As in DeepSpeed, gathers issued during forward
(also prefetches of the first backward modules) use the primary partition and refresh the secondary one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ds_zero.zero3.param import ZeroParamStatus, install_full
from ds_zero.zeropp.exchange import all_gather, start_all_gather
from ds_zero.zeropp.frozen import is_stored_quantized, packed
from ds_zero.zeropp.quant import dequantize_packed, quantize_packed, wire_bytes


def _in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (its graph task id is -1 outside one)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def uses_zeropp(param: torch.nn.Parameter) -> bool:
    return hasattr(param.ds_space, "secondary")


def gather_kind(param: torch.nn.Parameter) -> tuple[bool, bool, bool]:
    """(from the hpZ secondary partition, quantized for the exchange, stored quantized: sent as stored):
    parameters of one exchange share all three."""
    space = param.ds_space
    secondary = space.secondary is not None and getattr(param, "ds_secondary", None) is not None and _in_backward()
    stored = not secondary and is_stored_quantized(param)
    quantized = not stored and bool(space.quantize or (space.quantize_frozen and not param.requires_grad))
    return secondary, quantized, stored


class ZeroPPBatch:
    """One gather of ``params`` (same group, dtype, compute device and :func:`gather_kind`)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.space = params[0].ds_space
        self.secondary, self.quantized, self.stored = gather_kind(params[0])
        group = self.space.secondary if self.secondary else self.space
        self.group, self.world, self.rank = group.group, group.world, group.rank
        self.shards = [p.ds_secondary if self.secondary else p.ds_tensor for p in params]
        self.unit = sum(s.numel() for s in self.shards)
        self.works: list[Any] = []
        self.out: torch.Tensor | None = None

    def start(self) -> None:
        dtype, device = self.params[0].dtype, self.space.compute_device
        for p in self.params:
            p.ds_status = ZeroParamStatus.INFLIGHT
        if self.stored:  # each partition's codes and scales, back to back
            mine = torch.cat([packed(p) for p in self.params]).to(device)
        else:
            mine = torch.cat([s.reshape(-1) for s in self.shards]).to(device, dtype)
        if self.quantized:
            mine = quantize_packed(mine, self.space.block)
        self.out = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=device)
        if self.space.hierarchy is not None and not self.secondary and self.world > 1:
            self._hierarchical(mine)
        else:
            self.works = start_all_gather(self.out, mine, self.group, self.world, self.rank, self.space.comm,
                                          "param_gather_secondary" if self.secondary else "param_gather")

    def _hierarchical(self, mine: torch.Tensor) -> None:
        """Across nodes first (``N`` chunks, one per node), then within the node (``L`` blocks of ``N`` chunks):
        ``[L, N, c]`` whose ``[l, n]`` is the chunk of shard rank ``n*L + l``."""
        across, within = self.space.hierarchy
        comm, n = self.space.comm, mine.numel()
        stage1 = all_gather(torch.empty(across.world * n, dtype=mine.dtype, device=mine.device), mine,
                            across.group, across.world, across.rank, comm, "param_gather")
        stage2 = all_gather(torch.empty(within.world * stage1.numel(), dtype=mine.dtype, device=mine.device),
                            stage1, within.group, within.world, within.rank, comm, "param_gather")
        self.out.copy_(stage2.view(within.world, across.world, n).transpose(0, 1).reshape(-1))

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        dtype = self.params[0].dtype
        if self.stored:
            self._finish_stored(dtype)
            return
        if self.quantized:
            rows = self.out.view(self.world, -1)
            grid = torch.stack([dequantize_packed(row, self.unit, self.space.block, dtype) for row in rows])
        else:
            grid = self.out.view(self.world, self.unit)
        offset = 0
        for p, shard in zip(self.params, self.shards, strict=True):
            size = shard.numel()
            full = grid.narrow(1, offset, size).reshape(-1)[:p.ds_numel]
            if self.world == 1:  # a view of the packed buffer: each parameter gets its own storage
                full = full.clone()
            install_full(p, full)
            if self.space.secondary is not None and not self.secondary:
                keep_secondary(p, full)
            offset += size
        self.out = None


    def _finish_stored(self, dtype: torch.dtype) -> None:
        rows = self.out.view(self.world, -1)
        offset = 0
        for p in self.params:
            part = p.ds_tensor.numel()
            size = wire_bytes(part, p.ds_quant_block)
            pieces = [dequantize_packed(row.narrow(0, offset, size), part, p.ds_quant_block, dtype) for row in rows]
            full = torch.cat(pieces)[:p.ds_numel]
            install_full(p, full)
            if self.space.secondary is not None:
                keep_secondary(p, full)
            offset += size
        self.out = None


def keep_secondary(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """hpZ: this rank's slice of the whole value for its secondary group."""
    group = param.ds_space.secondary
    part = math.ceil(param.ds_numel / group.world) if param.ds_numel else 0
    start = min(group.rank * part, param.ds_numel)
    end = min(start + part, param.ds_numel)
    piece = torch.zeros(part, dtype=full.dtype, device=param.ds_tensor.device)
    piece[:end - start].copy_(full.reshape(-1)[start:end])
    param.ds_secondary = piece


def secondary_numel(param: torch.nn.Parameter) -> int:
    """Elements of the hpZ secondary partition of ``param`` (0 without hpZ)."""
    group = getattr(param.ds_space, "secondary", None)
    return 0 if group is None else math.ceil(param.ds_numel / group.world)
