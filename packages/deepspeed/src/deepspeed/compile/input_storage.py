"""``InputStorage``: a graph's real inputs kept between Dynamo's backend call and AOT autograd's (possibly
repeated) compiler calls, as metadata plus, where asked, the values themselves.

Floating tensors are kept as shape/dtype/stride metadata and rebuilt as ones (profiling needs realistic shapes,
not values); integer tensors (indices, lengths) keep their values by default (``keep_int_input_tensors``), since
a dummy index can be out of range; ``keep_all_input_tensors`` keeps every value. Kept values are copied to the
CPU so the storage does not pin accelerator memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorMetadata:
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    stride: tuple
    storage_offset: int
    requires_grad: bool
    layout: torch.layout
    is_parameter: bool
    real_data: torch.Tensor | None = None


class InputStorage:
    """Real inputs of one graph (see the module docstring)."""

    def __init__(self, keep_int_input_tensors: bool = False, keep_all_input_tensors: bool = False) -> None:
        self.keep_int_input_tensors = keep_int_input_tensors
        self.keep_all_input_tensors = keep_all_input_tensors
        self._stored: Any = None
        self._has_data = False

    def _keeps_value(self, t: torch.Tensor) -> bool:
        if self.keep_all_input_tensors:
            return True
        return self.keep_int_input_tensors and not (t.is_floating_point() or t.is_complex())

    def _store(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            real = value.detach().to("cpu", copy=True) if self._keeps_value(value) else None
            return TensorMetadata(tuple(value.shape), value.dtype, value.device, tuple(value.stride()),
                                  value.storage_offset(), value.requires_grad, value.layout,
                                  isinstance(value, torch.nn.Parameter), real)
        if isinstance(value, tuple):
            return tuple(self._store(v) for v in value)
        if isinstance(value, list):
            return [self._store(v) for v in value]
        if isinstance(value, dict):
            return {k: self._store(v) for k, v in value.items()}
        return value

    @staticmethod
    def _rebuild(meta: TensorMetadata) -> torch.Tensor:
        if meta.real_data is not None:
            t = meta.real_data.clone()
        else:
            t = torch.ones(meta.shape, dtype=meta.dtype, layout=meta.layout)
        if len(meta.shape) > 0 and t.stride() != meta.stride:
            try:
                base = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)
                base.copy_(t)
                t = base
            except RuntimeError:
                pass  # a stride torch cannot build for this shape: the contiguous value stands in
        t = t.to(meta.device)
        if meta.requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        if meta.is_parameter:
            t = torch.nn.Parameter(t, requires_grad=meta.requires_grad)
        return t

    def _materialize(self, value: Any) -> Any:
        if isinstance(value, TensorMetadata):
            return self._rebuild(value)
        if isinstance(value, tuple):
            return tuple(self._materialize(v) for v in value)
        if isinstance(value, list):
            return [self._materialize(v) for v in value]
        if isinstance(value, dict):
            return {k: self._materialize(v) for k, v in value.items()}
        return value

    def put(self, real_inputs: Any) -> None:
        self._stored = self._store(real_inputs)
        self._has_data = True

    def get(self) -> Any:
        """Fresh tensors rebuilt from what ``put`` kept."""
        if not self._has_data:
            raise RuntimeError("InputStorage.get(): no inputs stored (call put() first)")
        return self._materialize(self._stored)

    def has_data(self) -> bool:
        return self._has_data

    def clear(self) -> None:
        self._stored, self._has_data = None, False
