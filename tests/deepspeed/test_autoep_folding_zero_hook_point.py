"""DeepSpeed's ZeRO-1/2 hook point for AutoEP+AutoTP folding leaves a gradient its backward hook corrected alone."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from ds_moe.autoep.folded import FOLDING_HOOKED_ATTR
from ds_moe.autoep.folding import AUTOEP_FOLDING_GRAD_REDUCE_SKIP


def test_hooked_parameter_is_not_corrected_twice_at_zero2():
    param = torch.nn.Parameter(torch.ones(4))
    grad = torch.full((4, ), 2.0)
    setattr(param, FOLDING_HOOKED_ATTR, True)
    # ZeRO-2 corrects without the once-per-step marker: only the hooked flag can stop a second division
    optimizer = SimpleNamespace(autoep_folding_spec=SimpleNamespace(tp_size=2), partition_gradients=True,
                                overlap_comm=False, autoep_folding_tp_group=None)
    strategy = DeepSpeedZeroOptimizer._maybe_reduce_autoep_folding_tp_gradient(optimizer, param, grad)
    assert strategy == AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    assert torch.equal(grad, torch.full((4, ), 2.0))
