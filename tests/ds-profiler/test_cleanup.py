"""Leaves no trace: after end_profile (also when the forward raises) the model, its hooks, torch's
functions and the dispatch-mode stack are exactly as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ds_profiler import FlopsProfiler, get_model_profile

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
               "_backward_hooks", "_backward_pre_hooks")


class Boom(nn.Module):
    def __init__(self, fail: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.fail = fail

    def forward(self, x):
        x = self.inner(self.fc(x))
        if self.fail:
            raise RuntimeError("boom")
        return x


class Failing(nn.Module):
    """Raises from inside a nested submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Boom()

    def forward(self, x):
        return self.block(x)


def snapshot(model: nn.Module) -> dict:
    state = {
        "modules": [(name, sorted(vars(m)), {h: dict(getattr(m, h)) for h in _HOOK_DICTS})
                    for name, m in model.named_modules()],
        "functional": {k: id(v) for k, v in vars(F).items()},
        "torch": {k: id(v) for k, v in vars(torch).items()},
        "tensor": {k: id(v) for k, v in vars(torch.Tensor).items()},
        "global_hooks": (len(module_mod._global_forward_hooks), len(module_mod._global_forward_pre_hooks)),
        "dispatch": torch._C._len_torch_dispatch_stack(),
    }
    return state


def same(after: dict, before: dict) -> bool:
    """Equal, except that torch may have lazily imported new submodules (new keys, nothing replaced)."""
    for key in ("functional", "torch", "tensor"):
        if any(after[key].get(name) != ident for name, ident in before[key].items()):
            return False
    strip = ("functional", "torch", "tensor")
    return {k: v for k, v in after.items() if k not in strip} == {k: v for k, v in before.items() if k not in strip}


def test_end_profile_restores_everything():
    model = Boom(fail=False)
    before = snapshot(model)
    prof = FlopsProfiler(model)
    prof.start_profile()
    assert torch._C._len_torch_dispatch_stack() == 1
    model(torch.randn(2, 4))
    prof.end_profile()
    assert same(snapshot(model), before)
    assert _get_current_dispatch_mode() is None


def test_forward_raising_then_end_profile_leaves_no_trace_and_profiler_still_works():
    model = Failing()
    before = snapshot(model)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4))
    assert prof._recorder.stack == []  # hooks ran on the way out of every module
    prof.end_profile()
    assert same(snapshot(model), before)
    model.block.fail = False
    prof.start_profile()
    model(torch.randn(2, 4))
    assert prof.get_total_macs() == 2 * 2 * 16
    prof.end_profile()
    assert same(snapshot(model), before)


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_get_model_profile_cleans_up_when_the_call_raises(mode):
    model = Failing()
    model.block.fail = False
    before = snapshot(model)
    model.block.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        get_model_profile(model, input_shape=(2, 4), warm_up=0, mode=mode, print_profile=False)
    model.block.fail = False
    assert same(snapshot(model), before)


def test_stop_is_idempotent_and_results_survive_it():
    model = nn.Linear(3, 3)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(1, 3))
    prof.stop_profile()
    prof.stop_profile()
    assert torch._C._len_torch_dispatch_stack() == 0
    model(torch.randn(1, 3))  # not counted any more
    assert prof.get_total_macs() == 9
    prof.end_profile()
    prof.end_profile()


def test_start_twice_restarts_without_stacking_modes():
    model = nn.Linear(3, 3)
    prof = FlopsProfiler(model)
    prof.start_profile()
    prof.start_profile()
    assert torch._C._len_torch_dispatch_stack() == 1
    model(torch.randn(1, 3))
    assert prof.get_total_macs() == 9
    prof.end_profile()
    assert torch._C._len_torch_dispatch_stack() == 0
