"""``CUDA_Accelerator``: NVIDIA (and ROCm builds of torch, which answer to ``cuda``) over NCCL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """The CUDA devices of this process, through ``torch.cuda``."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    @property
    def default_generator(self) -> Callable[[int], torch.Generator]:
        return lambda index: torch.cuda.default_generators[index]

    # -- memory: the caching allocator's figures, bytes ---------------------------------------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def total_memory(self, device_index: int | None = None) -> int:
        index = self.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    # -- dtypes -------------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """fp16 tensor-core math needs compute capability >= 7.0 (Volta)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 7

    def is_triton_supported(self) -> bool:
        if not torch.cuda.is_available():
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return torch.cuda.get_device_capability()[0] >= 8

    # -- tensors, ranges, environment ---------------------------------------------------------------------
    # pin_memory / is_pinned / unpin_memory: the base class's, over torch's CUDA pinned allocator
    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """``cudaHostRegister`` the range (natively pinned buffers then copy to the GPU asynchronously)."""
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)))
        return True

    def unregister_host_memory(self, address: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        torch.cuda._lazy_call(callback)

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"]
