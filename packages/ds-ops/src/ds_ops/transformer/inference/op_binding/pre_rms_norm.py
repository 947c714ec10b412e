"""``PreRMSNormOp``: the residual add before an RMSNorm: returns ``(RMSNorm(vals + residual), vals + residual)``,
the sum in fp32 and handed back in ``gamma``'s dtype as the new residual stream."""

from __future__ import annotations

import torch

from .base import DefaultConfigOp
from .rms_norm import RMSNormOp


class PreRMSNormOp(DefaultConfigOp):
    @staticmethod
    def pre_rms_norm_func(vals: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                          epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = vals.float() + residual.float()
        return RMSNormOp.rms_norm_func(summed, gamma, epsilon), summed.to(gamma.dtype)

    def forward(self, vals: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pre_rms_norm_func(vals, residual, gamma, epsilon)
