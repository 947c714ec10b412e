"""``MPS_Accelerator``: the Apple-silicon GPU through ``torch.mps``, ranks over ``gloo``.

``torch.mps`` has one device and a smaller API than ``torch.cuda``: no device selection, an RNG without device
arguments, and allocator figures under other names (``current_allocated_memory``, ``driver_allocated_memory``,
``recommended_max_memory``), mapped here; it keeps no peak counter, so the peak is the current figure.
"""

from __future__ import annotations

import torch

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class MPS_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "mps"
    _communication_backend_name = "gloo"

    def is_available(self) -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def current_device(self) -> int:
        return 0

    def set_device(self, device_index: int) -> None:
        if device_index != 0:
            raise ValueError(f"set_device: MPS has one device (index 0), got {device_index!r}")

    def synchronize(self, device_index: int | None = None) -> None:
        torch.mps.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.mps.set_rng_state(new_state)

    def memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.mps.current_allocated_memory())

    max_memory_allocated = memory_allocated

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """No peak counter to reset (the peak reported is the current figure)."""

    def memory_reserved(self, device_index: int | None = None) -> int:
        return int(torch.mps.driver_allocated_memory())

    max_memory_reserved = memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "reserved_bytes.all.current": self.memory_reserved()}

    def total_memory(self, device_index: int | None = None) -> int:
        return int(torch.mps.recommended_max_memory())

    def available_memory(self, device_index: int | None = None) -> int:
        return self.total_memory() - self.memory_reserved()

    def is_bf16_supported(self) -> bool:
        return self.is_available()  # macOS 14+, which torch's MPS backend requires for bf16 anyway
