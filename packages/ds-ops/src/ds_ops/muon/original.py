"""Muon optimizers over whole (unpartitioned) parameters: ``deepspeed.runtime.zero.muon.original_muon``.

- :class:`SingleDeviceMuon` / :class:`SingleDeviceMuonWithAuxAdam`: every rank updates every parameter (the
  gradients must already be identical on every rank, e.g. averaged by data parallelism).
- :class:`Muon` / :class:`MuonWithAuxAdam`: the Muon parameters (sorted by size, largest first) are dealt out
  round-robin over the default process group: rank ``r`` computes the update of parameters ``r, r + W, ...``
  and an all-gather per round of ``W`` parameters gives every rank the new values, so the Newton-Schulz work is
  split ``W`` ways. Every rank must call ``step`` (a collective).

The ``AuxAdam`` variants take parameter groups flagged ``use_muon``: Muon for hidden weight matrices, Adam for
the rest (embeddings, heads, biases, gains), with decoupled weight decay ``p <- p (1 - lr wd)`` in both.
Defaults: Muon groups ``lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram"``; Adam groups
``lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ds_ops.muon.newton_schulz import adam_update, check_ns_method, muon_update

ORTHOGONALIZED = "muon_update_precomputed"
"""Parameter-group key: True when the group's gradients already are Muon's updates (set by ZeRO, whose flat
partitions cannot be orthogonalised: ``ds_zero.muon`` computes the updates from the full gradients)."""

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def complete_groups(param_groups: Iterable[dict[str, Any]], sort_muon: bool) -> list[dict[str, Any]]:
    """Each group with its defaults filled in; a group without ``use_muon`` or with a bad value is an error."""
    out = []
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict) or "use_muon" not in group:
            raise ValueError(f"MuonWithAuxAdam: parameter group {index} has no 'use_muon' flag; every group must say "
                             "use_muon=True (Muon) or use_muon=False (Adam)")
        group = {**(MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS), **group}
        group["params"] = list(group["params"])
        if group["use_muon"]:
            check_ns_method(group["ns_method"], f"parameter group {index}: ns_method")
            if not 0.0 <= group["momentum"] < 1.0:
                raise ValueError(f"parameter group {index}: momentum={group['momentum']}: accepted is [0, 1)")
            if sort_muon:
                group["params"] = sorted(group["params"], key=lambda p: p.numel(), reverse=True)
        if group["lr"] < 0:
            raise ValueError(f"parameter group {index}: lr={group['lr']}: accepted is >= 0")
        out.append(group)
    return out


def _muon_param(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """One Muon update of a whole parameter (a missing gradient counts as zero, as DeepSpeed's does)."""
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    update = muon_update(grad, state["momentum_buffer"], beta=group["momentum"], ns_method=group["ns_method"],
                         is_expert_group=getattr(p, "is_expert_group", False))
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(update.reshape(p.shape), alpha=-group["lr"])


def _apply_precomputed(group: dict[str, Any]) -> None:
    """``p <- p (1 - lr wd) - lr update``, the update being the gradient ZeRO left (see ``ORTHOGONALIZED``)."""
    for p in group["params"]:
        p.mul_(1 - group["lr"] * group["weight_decay"])
        if p.grad is not None:
            p.add_(p.grad.reshape(p.shape), alpha=-group["lr"])


def _adam_param(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    if not state:
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] = 0
    state["step"] += 1
    update = adam_update(grad, state["exp_avg"], state["exp_avg_sq"], state["step"], tuple(group["betas"]),
                         group["eps"])
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(update, alpha=-group["lr"])


def _round_robin(params: list[torch.Tensor], update: Callable[[torch.Tensor], None]) -> None:
    """Rank ``r`` updates ``params[r::W]``; each round's new values are all-gathered to every rank."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if world == 1:
        for p in params:
            update(p)
        return
    for base in range(0, len(params), world):
        chunk = params[base:base + world]
        mine = chunk[rank] if rank < len(chunk) else None
        if mine is not None:
            update(mine)
        # same-shaped slots for the gather: the round's parameters differ in shape, so each goes flat through
        # a buffer the size of the round's largest
        size = max(p.numel() for p in chunk)
        send = torch.zeros(size, dtype=chunk[0].dtype, device=chunk[0].device)
        if mine is not None:
            send[:mine.numel()].copy_(mine.detach().reshape(-1).to(send.dtype))
        slots = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(slots, send)
        for r, p in enumerate(chunk):
            if r != rank:
                p.data.copy_(slots[r][:p.numel()].view_as(p))


def _muon_group_step(group: dict[str, Any], state: dict[Any, Any], distributed: bool) -> None:
    """One Muon step of ``group``: ZeRO's precomputed updates applied as they are, else each parameter's own
    update (split round-robin over the ranks when ``distributed``)."""
    if group.get(ORTHOGONALIZED):
        _apply_precomputed(group)
        return

    def one(p: torch.Tensor) -> None:
        _muon_param(p, state[p], group)

    if distributed:
        _round_robin(group["params"], one)
    else:
        for p in group["params"]:
            one(p)


class _MuonBase(torch.optim.Optimizer):
    distributed = False

    def __init__(self, params: Iterable[Any], lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 ns_method: str = "gram") -> None:
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: got no parameters")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        groups = [{**g, "use_muon": True} for g in groups]
        groups = complete_groups([{"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                                   "ns_method": ns_method, **g} for g in groups], sort_muon=self.distributed)
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _muon_group_step(group, self.state, self.distributed)
        return loss


class SingleDeviceMuon(_MuonBase):
    """Muon (MomentUm Orthogonalized by Newton-Schulz) for hidden weight matrices, on one device: ``lr`` is in
    units of spectral norm per step, ``weight_decay`` decoupled, ``momentum`` the Nesterov momentum."""


class Muon(_MuonBase):
    """:class:`SingleDeviceMuon` with the Newton-Schulz work split round-robin over the default process group."""

    distributed = True


class _AuxAdamBase(torch.optim.Optimizer):
    distributed = False

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        super().__init__(complete_groups(param_groups, sort_muon=self.distributed), {})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                _muon_group_step(group, self.state, self.distributed)
            else:
                for p in group["params"]:
                    _adam_param(p, self.state[p], group)
        return loss


class SingleDeviceMuonWithAuxAdam(_AuxAdamBase):
    """Muon for the ``use_muon=True`` groups and Adam for the others, every parameter on every rank."""


class MuonWithAuxAdam(_AuxAdamBase):
    """:class:`SingleDeviceMuonWithAuxAdam` with the Muon work split round-robin over the default process group."""

    distributed = True
