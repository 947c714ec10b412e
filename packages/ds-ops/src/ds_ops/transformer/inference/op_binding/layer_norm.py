"""``LayerNormOp``: LayerNorm over the last dimension in fp32, rounded to ``gamma``'s dtype; the residual forms
normalise ``vals + bias + res`` (and can also return that pre-norm sum, for a pre-LN residual stream)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import DefaultConfigOp


def _norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float) -> torch.Tensor:
    return F.layer_norm(x, (gamma.shape[0],), weight=gamma.float(), bias=beta.float(), eps=epsilon).to(gamma.dtype)


def _residual_sum(vals: torch.Tensor, bias: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    return vals.float() + bias.float().reshape(1, 1, -1) + res.float()


class LayerNormOp(DefaultConfigOp):
    @staticmethod
    def layer_norm_func(vals: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float) -> torch.Tensor:
        return _norm(vals.float(), gamma, beta, epsilon)

    @staticmethod
    def layer_norm_residual(vals: torch.Tensor, bias: torch.Tensor, res: torch.Tensor, gamma: torch.Tensor,
                            beta: torch.Tensor, epsilon: float) -> torch.Tensor:
        return _norm(_residual_sum(vals, bias, res), gamma, beta, epsilon)

    @staticmethod
    def layer_norm_residual_store_pre_ln_res(vals: torch.Tensor, bias: torch.Tensor, res: torch.Tensor,
                                             gamma: torch.Tensor, beta: torch.Tensor,
                                             epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = _residual_sum(vals, bias, res)
        return _norm(summed, gamma, beta, epsilon), summed.to(gamma.dtype)

    def forward(self, vals: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float) -> torch.Tensor:
        return self.layer_norm_func(vals, gamma, beta, epsilon)
