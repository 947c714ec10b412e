"""Property-based checks: hyper-parameter validation and the low-precision copy on arbitrary float32 values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_ops import DeepSpeedCPUAdam, DeepSpeedCPULion

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5))


@settings(max_examples=60, deadline=None)
@given(lr=numbers, beta1=numbers, beta2=numbers, eps=numbers, weight_decay=numbers)
def test_hyper_parameters_are_accepted_or_named_in_the_error(ops_cache, lr, beta1, beta2, eps, weight_decay):
    valid = (all(math.isfinite(x) for x in (lr, beta1, beta2, eps, weight_decay)) and lr >= 0 and eps >= 0
             and weight_decay >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1)
    params = [torch.nn.Parameter(torch.zeros(2))]
    kwargs = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    if valid:
        DeepSpeedCPUAdam(params, **kwargs)
    else:
        with pytest.raises(ValueError, match=r"DeepSpeedCPUAdam: (lr|betas\[[01]\]|eps|weight_decay)="):
            DeepSpeedCPUAdam(params, **kwargs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=70))
def test_update_and_copy_rounds_like_torch(ops_cache, values):
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))
    p.grad = torch.zeros_like(p)
    opt = DeepSpeedCPULion([p], lr=0.0)  # Lion with lr=0 leaves every value, inf included, unchanged
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(p.numel(), dtype=dtype)
        opt.step(fp16_param_groups=[[out]])
        assert torch.equal(out.view(torch.int16), p.detach().to(dtype).view(torch.int16))
