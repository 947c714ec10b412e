"""``deepspeed.accelerator``: the device abstraction (``get_accelerator()``) over ``torch.device`` types."""

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.accelerator.real_accelerator import (
    SUPPORTED_ACCELERATOR_LIST,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "CPU_Accelerator",
    "CUDA_Accelerator",
    "DeepSpeedAccelerator",
    "SUPPORTED_ACCELERATOR_LIST",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
