"""Whole models against torch.utils.flop_counter.FlopCounterMode: the matmul/conv FLOPs (2 x our MACs) must
agree exactly, forward and forward + backward. FlopCounterMode counts only the matmul/conv/attention family;
our FLOPs additionally hold normalizations, softmax, activations, elementwise ops and reductions."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ds_profiler import FlopsProfiler


def _inputs(tiny, name):
    torch.manual_seed(0)
    if name == "gpt2":
        return tiny.TinyGPT2(), (), {"input_ids": torch.randint(0, 128, (2, 12))}
    if name == "bert":
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0
        return tiny.TinyBert(), (torch.randint(0, 128, (2, 12)),), {"attention_mask": mask}
    return tiny.SmallCNN(), (torch.randn(2, 3, 16, 16),), {}


def _first_float(output):
    if isinstance(output, dict):
        output = next(iter(output.values()))
    return output


def reference(model, args, kwargs, backward: bool) -> int:
    with FlopCounterMode(display=False) as mode:
        out = _first_float(model(*args, **kwargs))
        if backward:
            out.sum().backward()
    return mode.get_total_flops()


def ours(model, args, kwargs, backward: bool) -> tuple[int, int, int]:
    prof = FlopsProfiler(model)
    prof.start_profile()
    try:
        out = _first_float(model(*args, **kwargs))
        if backward:
            out.sum().backward()
        return prof.get_total_macs(), prof.get_total_backward_macs(), prof.get_total_flops()
    finally:
        prof.end_profile()


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "train"])
def test_matmul_and_conv_flops_agree_with_flop_counter_mode(tiny, name, backward):
    model, args, kwargs = _inputs(tiny, name)
    expected = reference(model, args, kwargs, backward)
    model.zero_grad(set_to_none=True)
    fwd_macs, bwd_macs, fwd_flops = ours(model, args, kwargs, backward)
    assert expected > 0
    assert 2 * (fwd_macs + bwd_macs) == expected
    assert fwd_flops > 2 * fwd_macs  # the non-matmul work FlopCounterMode leaves out
    assert (bwd_macs > 0) == backward
