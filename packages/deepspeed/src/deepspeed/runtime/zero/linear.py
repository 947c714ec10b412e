"""``deepspeed.runtime.zero.linear``: DeepSpeed's memory-efficient linear for ZeRO-3 (ds-zero's
``memory_efficient_linear``): the autograd function keeps the weight *parameter* for backward, not a gathered
copy, so a released weight really frees its memory between forward and backward."""

from __future__ import annotations

import functools

import torch

from deepspeed.accelerator import get_accelerator
from ds_zero.zero3.linear import LinearFunctionForZeroStage3, zero3_linear_wrap

# torch.amp's custom-function decorators bound to this accelerator's device type: an autograd function decorated
# with them runs its backward under the autocast state its forward saw (DeepSpeed's names)
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=get_accelerator().device_name())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=get_accelerator().device_name())

class LinearModuleForZeroStage3(torch.nn.Linear):
    """``nn.Linear`` whose forward goes through ``zero3_linear_wrap``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return zero3_linear_wrap(input, self.weight, self.bias)


__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "autocast_custom_bwd", "autocast_custom_fwd",
           "zero3_linear_wrap"]
