"""The device families beyond CPU and CUDA (``xpu``, ``npu``, ``mps``, ``hpu``, ``mlu``, ``sdaa``, ``supa``,
``klxpu``): each module defines exactly DeepSpeed's class, every one is concrete, selecting one that is not usable
here is a clear error, and ``DeviceModuleAccelerator`` really delegates to the torch device module."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import deepspeed.accelerator as accelerator_pkg
from deepspeed.accelerator import real_accelerator
from deepspeed.accelerator.device_module import DeviceModuleAccelerator
from deepspeed.accelerator.klxpu_accelerator import KLXPU_Accelerator

FAMILIES = {"hpu": "hccl", "npu": "hccl", "mlu": "cncl", "sdaa": "tccl", "supa": "bccl", "xpu": None, "mps": "gloo"}


def _modules() -> list[str]:
    folder = accelerator_pkg.__path__[0]
    return sorted(f[:-3] for f in os.listdir(folder)
                  if f.endswith("_accelerator.py") and f not in ("abstract_accelerator.py", "real_accelerator.py"))


def test_every_supported_family_has_one_concrete_class():
    modules = _modules()
    assert [m.removesuffix("_accelerator") for m in modules] == sorted(real_accelerator.SUPPORTED_ACCELERATOR_LIST)
    for name in modules:
        module = importlib.import_module(f"deepspeed.accelerator.{name}")
        classes = [n for n in dir(module) if n.endswith("_Accelerator")]
        assert classes == [f"{name.removesuffix('_accelerator').upper()}_Accelerator"], name
        cls = getattr(module, classes[0])
        assert not cls.__abstractmethods__, f"{name}: abstract {sorted(cls.__abstractmethods__)}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_identity_and_unusable_selection(family, monkeypatch):
    cls = real_accelerator._ACCELERATORS[family]
    accel = cls()
    assert accel.name == family and accel.device_name(1) == f"{family}:1"
    if FAMILIES[family]:
        assert accel.communication_backend_name() == FAMILIES[family]
    if accel.is_available():
        pytest.skip(f"a {family} device is present")
    assert not accel.is_bf16_supported() and not accel.is_fp16_supported()
    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", family)
    with pytest.raises(ValueError, match=f"DS_ACCELERATOR='{family}' but no '{family}' device is usable"):
        real_accelerator.get_accelerator()


def test_missing_plugin_is_named():
    accel = real_accelerator._ACCELERATORS["npu"]()
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    with pytest.raises(RuntimeError, match="needs the 'torch_npu' package"):
        accel.device_count()


class _HostModule(DeviceModuleAccelerator):
    """The delegation checked against a device module every torch has: ``torch.cpu``."""

    _name = "cpu"
    _communication_backend_name = "gloo"


def test_delegates_to_the_torch_device_module():
    accel = _HostModule()
    assert accel.is_available() is torch.cpu.is_available()
    assert accel.device_count() == torch.cpu.device_count()
    with pytest.raises(ValueError):  # torch.cpu.current_device() answers "cpu", not an index
        accel.current_device()
    accel.synchronize()
    with pytest.raises(AttributeError, match="torch.cpu has no memory_allocated"):
        accel.memory_allocated()
    calls = []
    accel.lazy_call(lambda: calls.append(1))  # no _lazy_call in torch.cpu: runs now
    assert calls == [1]
    accel.range_push("step")
    accel.range_pop()
    with pytest.raises(RuntimeError, match="no open range"):
        accel.range_pop()


def test_klxpu_is_cuda_underneath(monkeypatch):
    accel = KLXPU_Accelerator()
    assert accel.name == "klxpu" and accel.device_name() == "cuda" and not accel.is_triton_supported()
    monkeypatch.setenv("XPU_EVENT_KL3_ENABLE", "1")
    assert not accel.use_host_timers()
    monkeypatch.delenv("XPU_EVENT_KL3_ENABLE")
    assert accel.use_host_timers()
