"""``GatedActivationOp``: a gated MLP activation (GeGLU / SwiGLU). ``activation + bias`` is split in two halves
along the last dimension, ``[hidden, gate]``; the result is ``hidden * act(gate)``, the activation in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ActivationFuncType
from .base import DefaultConfigOp

_GATES = {ActivationFuncType.GATED_GELU: F.gelu, ActivationFuncType.GATED_SILU: F.silu}


class GatedActivationOp(DefaultConfigOp):
    @staticmethod
    def gated_activation_func(activation: torch.Tensor, bias: torch.Tensor,
                              activation_func_type: ActivationFuncType) -> torch.Tensor:
        act = _GATES.get(activation_func_type)
        if act is None:
            raise ValueError(f"GatedActivationOp: activation_func_type {activation_func_type!r} is not a gated "
                             f"activation; accepted: {[t.name for t in _GATES]}")
        summed = activation + bias.reshape(1, 1, -1)
        hidden, gate = summed.chunk(2, dim=-1)
        return hidden * act(gate.float()).to(summed.dtype)

    def forward(self, activation: torch.Tensor, bias: torch.Tensor,
                activation_func_type: ActivationFuncType) -> torch.Tensor:
        return self.gated_activation_func(activation, bias, activation_func_type)
