"""Noise for the gate: DeepSpeed's ``Jitter`` (multiplicative) and ``RSample`` (Gumbel) policies."""

from __future__ import annotations

import torch
from torch import Tensor

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def check_noisy_gate_policy(policy: str | None) -> None:
    """Raise ``ValueError`` naming ``policy`` and the accepted values unless it is one of them."""
    if policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"Unsupported noisy_gate_policy: {policy!r}; accepted values are "
                         f"{', '.join(repr(p) for p in NOISY_GATE_POLICIES)}")


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times a uniform sample from ``[1 - epsilon, 1 + epsilon)`` (Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=device)
    high = torch.tensor(1.0 + epsilon, device=device)
    return x * torch.distributions.Uniform(low, high).rsample(x.shape)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """A standard Gumbel(0, 1) sample of ``shape`` (the Gumbel-max trick for sampled routing)."""
    zero = torch.tensor(0.0, device=device)
    one = torch.tensor(1.0, device=device)
    return torch.distributions.Gumbel(zero, one).rsample(shape)
