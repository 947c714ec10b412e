"""How ZeRO pins the host buffers of CPU optimizer offload (``offload_optimizer.pin_memory``), and frees them.

ds-zero sits below ``deepspeed`` and cannot reach its accelerator, so whoever builds a ZeRO optimizer passes a
:class:`HostPinning` in its settings. The default, :data:`TORCH_PINNING`, pins with torch where a CUDA device
can use the page-locked memory and leaves the tensor as it is otherwise (torch cannot pin without one), and
its ``unpin`` does nothing (torch frees a pinned buffer with its last tensor). The engine passes the
accelerator's ``pin_memory`` / ``unpin_memory`` under ``DS_PIN_MEMORY_BACKEND=native``, whose buffers are
locked on every device and are freed at once by ``unpin`` (the optimizer's ``destroy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TORCH_PINNING", "HostPinning", "PinnedBuffers"]


def _torch_pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def _torch_unpin(tensor: torch.Tensor) -> None:
    return None


@dataclass(frozen=True)
class HostPinning:
    """``pin(tensor)``: a page-locked copy of a CPU tensor (or the tensor itself where nothing can be pinned);
    ``unpin(pinned)``: free what ``pin`` returned now (a no-op where the buffer dies with its last tensor)."""

    pin: Callable[[torch.Tensor], torch.Tensor] = _torch_pin
    unpin: Callable[[torch.Tensor], Any] = _torch_unpin


TORCH_PINNING = HostPinning()


class PinnedBuffers:
    """The host buffers one owner pinned, released together. It holds what ``pin`` returned rather than the
    tensors built over it (``nn.Parameter``), whose ``.data`` ZeRO may rebind: the buffer freed is the one
    pinned, and it stays alive until released. With :data:`TORCH_PINNING` nothing is held (its buffers die
    with their last tensor, as they always have)."""

    def __init__(self, pinning: HostPinning) -> None:
        self.pinning = pinning
        self._track = pinning != TORCH_PINNING
        self._held: list[torch.Tensor] = []

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` pinned when it is on the CPU (else as it is)."""
        if tensor.device.type != "cpu":
            return tensor
        pinned = self.pinning.pin(tensor)
        if self._track and pinned is not tensor:
            self._held.append(pinned)
        return pinned

    def release(self) -> None:
        """Free every buffer pinned here (they must not be used afterwards)."""
        held, self._held = self._held, []
        for tensor in held:
            self.pinning.unpin(tensor)
