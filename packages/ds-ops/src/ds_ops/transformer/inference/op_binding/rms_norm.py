"""``RMSNormOp``: ``gamma * vals / sqrt(mean(vals^2) + epsilon)`` over the last dimension, the mean in fp32; for a
half-precision ``gamma`` the normalised values are rounded to its dtype before the scale."""

from __future__ import annotations

import torch

from .base import DefaultConfigOp


class RMSNormOp(DefaultConfigOp):
    @staticmethod
    def rms_norm_func(vals: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
        normalised = vals * torch.rsqrt(vals.float().pow(2).mean(-1, keepdim=True) + epsilon)
        if gamma.dtype in (torch.float16, torch.bfloat16):
            normalised = normalised.to(gamma.dtype)
        return gamma * normalised

    def forward(self, vals: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
        return self.rms_norm_func(vals, gamma, epsilon)
