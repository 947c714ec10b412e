"""Latency on an accelerator is taken after a device synchronize: checked on CPU with a stand-in device."""

from __future__ import annotations

import torch
from torch import nn

from ds_profiler import FlopsProfiler
from ds_profiler import _profiler as profiler_module


class _OnFakeDevice(nn.Module):
    """Reports its parameters as living on cuda:1 (only the device is read, nothing runs there)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def parameters(self, recurse: bool = True):
        yield torch.empty(0).as_subclass(_FakeCuda)


class _FakeCuda(torch.Tensor):
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 1)


def test_cpu_models_need_no_barrier():
    assert profiler_module.synchronizer(nn.Linear(2, 2)) is None
    assert profiler_module.synchronizer(nn.Linear(2, 2, device="meta")) is None
    assert profiler_module.synchronizer(nn.ReLU()) is None  # no parameters at all


def test_accelerator_models_synchronize_the_models_device(monkeypatch):
    seen: list[torch.device] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: seen.append(device))
    barrier = profiler_module.synchronizer(_OnFakeDevice())
    assert barrier is not None
    barrier()
    assert seen == [torch.device("cuda", 1)]


def test_each_module_call_is_timed_between_two_barriers(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(profiler_module, "synchronizer", lambda model: lambda: calls.append("sync"))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 4))
    prof.stop_profile()
    assert calls == ["sync"] * 6  # 3 module calls (Sequential, Linear, ReLU) x (before + after)
    assert prof.get_total_macs() == 2 * 4 * 4
    prof.end_profile()
