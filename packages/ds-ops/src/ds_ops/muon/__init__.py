"""Muon (MomentUm Orthogonalized by Newton-Schulz): ``deepspeed.runtime.zero.muon``.

``newton_schulz``: the orthogonalisation and the per-weight update; ``original``: the stand-alone optimizers
(DeepSpeed's ``original_muon``); ``optimizer``: the engine's ``MuonWithAuxAdam`` (``muon_optimizer``), whose
Muon groups ZeRO feeds with updates computed on full gradients (``ds_zero.muon``).
"""

from ds_ops.muon.newton_schulz import (
    NS_METHODS,
    adam_update,
    muon_update,
    zeropower_via_gram_newtonschulz,
    zeropower_via_newtonschulz5,
)
from ds_ops.muon.optimizer import ORTHOGONALIZED, MuonWithAuxAdam, is_muon_optimizer
from ds_ops.muon.original import Muon, SingleDeviceMuon, SingleDeviceMuonWithAuxAdam

__all__ = ["NS_METHODS", "ORTHOGONALIZED", "Muon", "MuonWithAuxAdam", "SingleDeviceMuon",
           "SingleDeviceMuonWithAuxAdam", "adam_update", "is_muon_optimizer", "muon_update",
           "zeropower_via_gram_newtonschulz", "zeropower_via_newtonschulz5"]
