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

import torch

from ds_ops.muon.original import ORTHOGONALIZED, _AuxAdamBase
from ds_ops.muon.original import MuonWithAuxAdam as _DistributedMuonWithAuxAdam

__all__ = ["ORTHOGONALIZED", "MuonWithAuxAdam", "is_muon_optimizer"]


class MuonWithAuxAdam(_DistributedMuonWithAuxAdam):
    """Muon for the ``use_muon=True`` groups, Adam for the others (see the module docstring)."""

    distributed = False


def is_muon_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """A Muon-with-auxiliary-Adam optimizer (this one or ``original_muon``'s), whose ``use_muon`` groups take
    ZeRO's precomputed updates."""
    return isinstance(optimizer, _AuxAdamBase)
