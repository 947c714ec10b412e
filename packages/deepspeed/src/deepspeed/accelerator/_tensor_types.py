"""The legacy typed-tensor constructors DeepSpeed's accelerators expose (``get_accelerator().FloatTensor``, ...).

``torch.FloatTensor(3)`` makes an uninitialised 3-element tensor and ``torch.FloatTensor([1, 2])`` one holding
the data; the accelerator's variants do the same on its device, so code written as
``get_accelerator().ByteTensor([flag])`` runs unchanged on CPU and CUDA. ``isinstance(t, FloatTensor)`` holds
for a tensor of that dtype on that device type.
"""

from __future__ import annotations

from typing import Any

import torch


class TypedTensor:
    """A constructor of ``dtype`` tensors on ``device`` (``device_type``: what ``isinstance`` compares)."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.dtype = dtype
        self.device = device
        self.device_type = torch.device(device).type

    def __call__(self, *args: Any) -> torch.Tensor:
        if not args:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        if all(isinstance(a, int) and not isinstance(a, bool) for a in args) or (
                len(args) == 1 and isinstance(args[0], torch.Size)):
            return torch.empty(*args, dtype=self.dtype, device=self.device)  # a size: uninitialised, as torch's
        if len(args) == 1:
            return torch.as_tensor(args[0], dtype=self.dtype, device=self.device)
        raise TypeError(f"{self!r}: pass a size (ints) or one sequence/tensor of data, got {args!r}")

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.dtype == self.dtype and obj.device.type == self.device_type

    def __repr__(self) -> str:
        return f"TypedTensor({self.dtype}, {self.device!r})"


TENSOR_TYPES = {"BFloat16Tensor": torch.bfloat16, "ByteTensor": torch.uint8, "DoubleTensor": torch.float64,
                "FloatTensor": torch.float32, "HalfTensor": torch.float16, "IntTensor": torch.int32,
                "LongTensor": torch.int64, "BoolTensor": torch.bool}
