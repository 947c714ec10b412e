"""``deepspeed.utils.pin_memory`` (DS_PIN_MEMORY_BACKEND=native) and the accelerator's pinning API over it."""

from __future__ import annotations

import gc

import pytest
import torch

import deepspeed.ops.op_builder as op_builder
import deepspeed.utils.pin_memory as pin_memory
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.pin_memory import NativePinnedMemory, get_active_native_pinned_memory


class _Registrar:
    """A device runtime that records what it was asked to register (alignment 4096, as some runtimes need)."""

    def __init__(self, fail_unregister: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.fail_unregister = fail_unregister

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        self.live[address] = num_bytes
        return True

    def unregister_host_memory(self, address: int) -> None:
        if self.fail_unregister:
            raise RuntimeError("device context is gone")
        del self.live[address]

    def pin_memory_alignment(self) -> int:
        return 4096


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> NativePinnedMemory:
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    pins = get_active_native_pinned_memory()
    assert pins is not None
    return pins


def test_pin_copies_tracks_views_and_frees_when_the_last_alias_dies():
    pins = NativePinnedMemory()
    src = torch.randn(6, 7, dtype=torch.float64)
    pinned = pins.pin(src)
    assert pinned.shape == src.shape and torch.equal(pinned, src) and pinned.ds_pinned
    begin = pinned.ds_pin_base
    view = pinned.reshape(-1)[10:20]
    assert pins.is_pinned(view) and not pins.is_pinned(src) and begin in pins._ranges
    del pinned
    gc.collect()
    assert begin in pins._ranges and view[0].item() == src.reshape(-1)[10].item()
    del view
    gc.collect()
    assert begin not in pins._ranges and pins.pinned_bytes() == 0


def test_unpin_frees_what_was_pinned_even_after_data_is_rebound():
    pins = NativePinnedMemory()
    pinned = pins.pin(torch.arange(64.0), match_shape=False)
    begin, keep = pinned.ds_pin_base, pinned[:1]
    pinned.data = torch.zeros(64)
    assert pins.unpin(pinned) is True and begin not in pins._ranges and not pinned.ds_pinned
    assert pins.unpin(pinned) is False  # nothing left to free
    with pytest.raises(RuntimeError, match="out of bounds"):  # the freed buffer is not silently readable
        keep.view(-1)[0].item()


def test_device_registration_is_aligned_and_undone():
    pins = NativePinnedMemory()
    dev = _Registrar()
    empty = pins.pin_empty(torch.empty(0, dtype=torch.bfloat16), (3, 5), registrar=dev)
    assert empty.shape == (3, 5) and empty.dtype == torch.bfloat16
    ((address, nbytes),) = dev.live.items()
    assert address % 4096 == 0 and address <= empty.data_ptr() and address + nbytes >= empty.data_ptr() + 30
    assert pins.unpin(empty) and dev.live == {}


def test_failed_unregistration_keeps_the_allocation(monkeypatch):
    pins = NativePinnedMemory()
    dev = _Registrar(fail_unregister=True)
    t = pins.pin(torch.ones(8), registrar=dev)
    assert pins.unpin(t) is False and pins.is_pinned(t)  # still registered, so never handed back to malloc
    monkeypatch.setenv("DS_PIN_MEMORY_REGISTER_DEVICE", "0")
    other = pins.pin(torch.ones(8), registrar=dev)
    assert len(dev.live) == 1 and pins.unpin(other) is True
    monkeypatch.setenv("DS_PIN_MEMORY_REGISTER_DEVICE", "maybe")
    with pytest.raises(ValueError, match="DS_PIN_MEMORY_REGISTER_DEVICE='maybe'"):
        pins.pin(torch.ones(8), registrar=dev)
    dev.fail_unregister = False
    assert pins.unpin(t) is True


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    assert get_active_native_pinned_memory() is None
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "mlock")
    with pytest.raises(ValueError, match="DS_PIN_MEMORY_BACKEND='mlock'"):
        get_active_native_pinned_memory()
    # native selected but the op cannot load: an error naming it, never a silent torch fallback
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setattr(pin_memory, "_shared_native_pins", None)

    class _Broken:
        def load(self):
            raise RuntimeError("no mlock here")

    monkeypatch.setattr(op_builder, "PinMemoryBuilder", _Broken)
    with pytest.raises(RuntimeError, match="pin_memory op.*no mlock here"):
        get_active_native_pinned_memory()


def test_accelerator_native_backend(native):
    accel = get_accelerator()
    src = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    pinned = accel.pin_memory(src)
    assert torch.equal(pinned, src) and accel.is_pinned(pinned) and accel.is_pinned(pinned[1, 3:])
    fresh = accel.pin_memory(src, make_copy=False, match_shape=False)
    assert fresh.shape == (24,) and accel.is_pinned(fresh)
    scratch = accel.pin_empty((4, 4), dtype=torch.float16)
    like = accel.pin_empty_like(src, dtype=torch.int32)
    assert scratch.shape == (4, 4) and like.shape == (2, 12) and like.dtype == torch.int32
    assert all(accel.is_pinned(t) for t in (scratch, like))
    for t in (pinned, fresh, scratch, like):
        assert accel.unpin_memory(t) is True and not accel.is_pinned(t)
    with pytest.raises(ValueError, match="device must be 'cpu'"):
        accel.pin_empty(4, dtype=torch.float32, device="meta")
    assert not accel.is_pinned(torch.empty(3, device="meta"))


def test_accelerator_torch_backend_on_cpu_is_a_no_op(monkeypatch):
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    accel = get_accelerator()
    t = torch.randn(5)
    if accel.device_name() == "cpu":
        assert accel.pin_memory(t) is t and not accel.is_pinned(t)
    assert accel.unpin_memory(t) is None
    assert accel.pin_empty(2, 3, dtype=torch.float32).shape == (2, 3)
