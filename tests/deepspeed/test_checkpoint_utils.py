"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: compact clones, containers, device."""

from __future__ import annotations

import io
from collections import namedtuple

import pytest
import torch

import deepspeed.checkpoint
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save


def _saved_bytes(obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def test_view_of_a_large_buffer_becomes_a_compact_clone():
    flat = torch.arange(100_000, dtype=torch.float32)  # stands for a flattened ZeRO buffer, 400 kB
    view = flat[10:20]
    clone = clone_tensors_for_torch_save(view)
    assert torch.equal(clone, view)
    assert clone.untyped_storage().nbytes() == 40 and view.untyped_storage().nbytes() == 400_000
    assert clone.data_ptr() != view.data_ptr()
    assert _saved_bytes(clone) < 2_000 < 400_000 < _saved_bytes(view)
    flat[10] = -1.0  # a copy, not an alias
    assert clone[0].item() == 10.0


def test_strided_and_transposed_views():
    base = torch.arange(24.0).reshape(4, 6)
    strided, transposed = base[:, ::2], base.t()
    out = clone_tensors_for_torch_save([strided, transposed])
    assert torch.equal(out[0], strided) and out[0].untyped_storage().nbytes() == strided.numel() * 4
    assert torch.equal(out[1], transposed) and out[1].untyped_storage().nbytes() == 24 * 4


def test_nested_containers_keep_their_types():
    Pair = namedtuple("Pair", "a b")
    weight = torch.nn.Parameter(torch.randn(3, 3))
    item = {"layer": [weight, (torch.ones(2), Pair(torch.zeros(1), "tag"))], "step": 7, "name": None}
    out = clone_tensors_for_torch_save(item)
    assert type(out["layer"]) is list and type(out["layer"][1]) is tuple and type(out["layer"][1][1]) is Pair
    assert out["step"] == 7 and out["name"] is None and out["layer"][1][1].b == "tag"
    cloned = out["layer"][0]
    assert type(cloned) is torch.Tensor and not cloned.requires_grad  # detached from autograd
    assert torch.equal(cloned, weight.detach()) and cloned.data_ptr() != weight.data_ptr()


def test_state_dict_round_trip_keeps_metadata():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    lean = clone_tensors_for_torch_save(state)
    assert type(lean) is type(state) and lean._metadata == state._metadata
    assert list(lean) == list(state)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    fresh.load_state_dict(lean)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values(), strict=True))


def test_device_argument_and_package_export():
    assert deepspeed.checkpoint.clone_tensors_for_torch_save is clone_tensors_for_torch_save
    t = torch.ones(3, dtype=torch.bfloat16)
    out = clone_tensors_for_torch_save({"t": t}, device="cpu")
    assert out["t"].device == torch.device("cpu") and out["t"].dtype == torch.bfloat16
    assert out["t"].data_ptr() != t.data_ptr()
    with pytest.raises(RuntimeError):
        clone_tensors_for_torch_save(t, device="no-such-device")


@pytest.mark.gpu
def test_clone_from_gpu_to_cpu_and_back():
    gpu = torch.arange(1000.0, device="cuda")[5:9]
    host = clone_tensors_for_torch_save(gpu)
    assert host.device.type == "cpu" and host.untyped_storage().nbytes() == 16
    back = clone_tensors_for_torch_save(host, device=torch.device("cuda"))
    assert back.is_cuda and torch.equal(back.cpu(), host)
    same = clone_tensors_for_torch_save(gpu, device="cuda:0")
    assert same.data_ptr() != gpu.data_ptr() and same.untyped_storage().nbytes() == 16
