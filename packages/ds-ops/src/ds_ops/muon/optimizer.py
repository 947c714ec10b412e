"""The Muon optimizer the engine builds for ``"optimizer": {"type": "Muon"}``:
``deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam``.

Without ZeRO it steps whole parameters: every rank holds the data-parallel average of every gradient, so each
computes the Muon updates itself (no collective: with tensor parallelism the default group's ranks hold
different shards, which a round-robin exchange would mix up). Under ZeRO the optimizer sees only flat
partitions, which cannot be orthogonalised: the ZeRO wrapper computes Muon's update on the full averaged
gradient of each weight (``ds_zero.muon``), leaves it as the partition's gradient and flags the group
``ORTHOGONALIZED``; the step then applies it as it is: ``p <- p (1 - lr wd) - lr update``.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_ops.muon.original import MuonWithAuxAdam as _DistributedMuonWithAuxAdam
from ds_ops.muon.original import _muon_param

ORTHOGONALIZED = "muon_update_precomputed"
"""Parameter-group key: True when the group's gradients already are Muon's updates (set by ZeRO)."""


class MuonWithAuxAdam(_DistributedMuonWithAuxAdam):
    """Muon for the ``use_muon=True`` groups, Adam for the others (see the module docstring)."""

    distributed = False

    def _muon_group(self, group: dict[str, Any]) -> None:
        if not group.get(ORTHOGONALIZED):
            for p in group["params"]:
                _muon_param(p, self.state[p], group)
            return
        for p in group["params"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
            if p.grad is not None:
                p.add_(p.grad.reshape(p.shape), alpha=-group["lr"])


def is_muon_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """An optimizer whose ``use_muon`` groups expect ZeRO to hand them Muon's updates."""
    return isinstance(optimizer, MuonWithAuxAdam)
