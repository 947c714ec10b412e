"""``enable_cuda_graph``: capture the module's forward once per input signature and replay it (CUDA only).

Inputs are copied into static buffers captured with the graph; the returned outputs are the graph's static
output tensors, overwritten by the next replay (as DeepSpeed's engine returns them): clone what you keep.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device)
        return ("value", repr(value))

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


class _Captured:
    def __init__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():  # warm-up: allocator pools, cuBLAS handles
            for _ in range(2):
                module(*self.args, **self.kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.outputs = module(*self.args, **self.kwargs)

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        for static, new in zip(self.args, args, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
        for key, new in kwargs.items():
            if isinstance(self.kwargs[key], torch.Tensor):
                self.kwargs[key].copy_(new)
        self.graph.replay()
        return self.outputs


class CudaGraphRunner:
    """Replays one captured CUDA graph per input signature (shapes, dtypes, non-tensor arguments)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.graphs: dict[tuple, _Captured] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _signature(args, kwargs)
        if key not in self.graphs:
            self.graphs[key] = _Captured(self.module, args, kwargs)
        return self.graphs[key](args, kwargs)
