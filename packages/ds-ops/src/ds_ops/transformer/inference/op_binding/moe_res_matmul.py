"""``MoEResMatmulOp``: a residual MoE's mix of the dense residual path and the experts' output, per hidden feature.
``coef`` is ``[1, 2 * hidden, 1]`` (the kernel's layout: both weight vectors stacked along dim 1); the first
``hidden`` weights scale ``residual``, the other ``hidden`` scale ``output``."""

from __future__ import annotations

import torch

from .base import DefaultConfigOp


class MoEResMatmulOp(DefaultConfigOp):
    @staticmethod
    def moe_res_matmul_func(residual: torch.Tensor, coef: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        weights = coef.transpose(1, 2).contiguous()
        to_residual, to_output = torch.split(weights, weights.shape[-1] // 2, dim=-1)
        return residual * to_residual + output * to_output

    def forward(self, residual: torch.Tensor, coef: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return self.moe_res_matmul_func(residual, coef, output)
