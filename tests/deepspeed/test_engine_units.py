"""Single-process properties of the engine's parts: loss-scaler invariants, reduction factors, bucket plans."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed.runtime.grad_reduce import ReduceOptions, _plan_buckets
from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler
from deepspeed.runtime.precision.optimizers import FP32Optimizer


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 5), st.integers(1, 4), st.booleans())
def test_dynamic_scaler_stays_in_bounds(overflows, window, hysteresis, consecutive):
    scaler = DynamicLossScaler(init_scale=2.0 ** 20, scale_window=window, min_scale=1.0, delayed_shift=hysteresis,
                               consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
    previous = scaler.loss_scale
    for overflow in overflows:
        scaler.update_scale(overflow)
        assert scaler.loss_scale >= 1.0
        ratio = scaler.loss_scale / previous
        assert ratio in ((0.5, 1.0) if overflow else (1.0, 2.0)) or (overflow and scaler.loss_scale == 1.0)
        assert 1 <= scaler.cur_hysteresis <= hysteresis
        previous = scaler.loss_scale


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.booleans(), st.floats(0.5, 64.0))
def test_reduction_factors_average(world, prescale, predivide):
    opts = ReduceOptions(world_size=world, prescale_gradients=prescale, gradient_predivide_factor=predivide)
    assert abs(opts.pre_factor * opts.post_factor * world - 1.0) < 1e-12


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(64, 40_000))
def test_bucket_plan_covers_every_parameter_once_in_reverse_order(sizes, bucket_bytes):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    wrapper = FP32Optimizer(torch.optim.SGD(params, lr=0.1))
    buckets = _plan_buckets(params, wrapper, ReduceOptions(world_size=2), bucket_bytes)
    order = [p for b in buckets for p in b.params]
    assert [id(p) for p in order] == [id(p) for p in reversed(params)]
    assert all(b.flat.numel() == sum(p.numel() for p in b.params) for b in buckets)
    # every bucket but the last reaches its size cap (the first one's cap is the small first-bucket size)
    assert all(b.flat.numel() * 4 >= min(bucket_bytes, 1 << 20) for b in buckets[:-1])
