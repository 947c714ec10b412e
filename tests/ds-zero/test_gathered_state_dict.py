"""``state_dict()`` of a ZeRO-3 model follows each parameter's state: inside ``GatheredParameters`` every gathered
parameter is its whole value (the recipe ``with GatheredParameters(model.parameters()): torch.save(
model.state_dict(), f)`` saves the real model), a released one is empty, and the engine's own model-states files
keep an empty tensor for every partitioned parameter however many are gathered. Saving empty weights for a
parameter whose full shape is not empty through ``save_16bit_model`` or ``zero_to_fp32`` is an error that names
it, never a silent empty file."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _zero3_toy import GLOBAL, TiedNet
from _zero3_toy import train_step as _step

ZERO = {"stage": 3, "stage3_param_persistence_threshold": 20, "reduce_bucket_size": 100}
NAMES = ("inp.weight", "inp.bias", "frozen.weight", "frozen.bias", "mid.weight", "mid.bias", "back.weight",
         "head.weight", "head.bias")


def _engine():
    import deepspeed

    torch.manual_seed(0)
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
              "steps_per_print": 10**6, "zero_optimization": ZERO,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "torch_adam": True}}}
    return deepspeed.initialize(model=TiedNet(scale=0.5), config=config)[0]


def _shapes(state: dict) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _gathered_recipe(tmp: str) -> dict:
    import deepspeed
    from deepspeed.runtime import checkpointing

    engine = _engine()
    for step in range(2):
        _step(engine, step)
    model = engine.module
    out: dict = {"outside": _shapes(model.state_dict())}
    with deepspeed.zero.GatheredParameters([model.mid.weight]):  # one gathered, the others not
        out["one"] = _shapes(model.state_dict())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        whole = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), os.path.join(tmp, "recipe.pt"))
        engine.save_checkpoint(tmp, tag="inside")  # the engine's files do not change with what is gathered
        checkpointing.save_16bit_model(model, tmp, "gathered.bin")  # the bare helper, on gathered weights
    out["whole"] = whole
    engine.save_checkpoint(tmp, tag="outside")
    try:  # released: the bare helper must refuse, not write empty tensors
        checkpointing.save_16bit_model(model, tmp, "released.bin", rank=0)
    except ValueError as exc:
        out["refused"] = str(exc)
    out["after"] = _shapes(model.state_dict())
    return out


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> tuple[str, list[dict]]:
    tmp = str(tmp_path_factory.mktemp("gathered_sd"))
    return tmp, run_distributed(_gathered_recipe, world_size=2, args=(tmp,), timeout=120)


def test_state_dict_inside_gathered_parameters_is_the_whole_model(recipe):
    tmp, results = recipe
    saved = torch.load(os.path.join(tmp, "recipe.pt"), weights_only=True)
    whole = results[0]["whole"]
    assert sorted(saved) == sorted([*NAMES, "scale"])
    for name in NAMES:
        assert torch.equal(saved[name], whole[name]), name
    assert saved["back.weight"].shape == (12, 12)  # a tied alias too
    plain = TiedNet(scale=0.5)
    plain.load_state_dict(saved)  # loads into an ordinary model, strict
    assert torch.equal(plain.head.weight, whole["head.weight"])


def test_only_released_parameters_are_empty(recipe):
    _, results = recipe
    for r in results:
        # persistent (<= 20 elements: the biases of 12 and 3) stay gathered after a step, as in DeepSpeed
        persistent = {"inp.bias": (12,), "frozen.bias": (12,), "mid.bias": (12,), "head.bias": (3,)}
        released = {k: (0,) for k in ("inp.weight", "frozen.weight", "mid.weight", "back.weight", "head.weight")}
        assert r["outside"] == {**persistent, **released, "scale": ()}
        assert r["one"] == {**r["outside"], "mid.weight": (12, 12), "back.weight": (12, 12)}
        assert r["after"] == r["outside"]  # leaving the block released them again


def test_engine_model_states_do_not_change_with_gathering(recipe):
    tmp, _ = recipe
    for rank in range(2):
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        inside = torch.load(os.path.join(tmp, "inside", name), weights_only=True)["module"]
        outside = torch.load(os.path.join(tmp, "outside", name), weights_only=True)["module"]
        assert _shapes(inside) == _shapes(outside) == {"scale": (), **{k: (0,) for k in NAMES}}


def test_save_16bit_model_refuses_released_weights(recipe):
    tmp, results = recipe
    message = results[0]["refused"]
    assert "empty tensor" in message and "inp.weight (12, 6)" in message and "GatheredParameters" in message
    assert "inp.bias" not in message  # persistent: whole, so saved as it is
    assert not os.path.exists(os.path.join(tmp, "released.bin"))
    gathered = torch.load(os.path.join(tmp, "gathered.bin"), weights_only=True)
    assert all(torch.equal(gathered[n], results[0]["whole"][n]) for n in NAMES)


def test_save_16bit_model_refuses_a_given_empty_state_dict(tmp_path):
    from deepspeed.runtime import checkpointing

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"weight \(2, 3\)"):
        checkpointing.save_16bit_model(model, tmp_path, state_dict={"weight": torch.empty(0), "bias": model.bias})
    assert not (tmp_path / "pytorch_model.bin").exists()
    empty = torch.nn.Module()  # a parameter whose full shape really is empty is saved as it is
    empty.weight = torch.nn.Parameter(torch.empty(2, 0))
    assert checkpointing.save_16bit_model(empty, tmp_path)
    assert torch.load(tmp_path / "pytorch_model.bin", weights_only=True)["weight"].shape == (2, 0)


def test_zero_to_fp32_refuses_a_shape_recorded_from_a_released_parameter(recipe, tmp_path):
    import shutil

    from ds_zero.zero_to_fp32 import ZeroToFp32Error, convert_zero_checkpoint_to_fp32_state_dict

    src, _ = recipe
    shutil.copytree(os.path.join(src, "outside"), tmp_path / "t")
    for rank in range(2):  # a writer that recorded param.shape (empty while released) instead of ds_shape
        path = tmp_path / "t" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        states = torch.load(path, weights_only=True)
        states["frozen_param_shapes"]["frozen.weight"] = torch.Size([0])
        torch.save(states, path)
    with pytest.raises(ZeroToFp32Error, match=r"'frozen.weight' is recorded with shape \(0,\).*72 values"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "out", tag="t")
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()
    convert_zero_checkpoint_to_fp32_state_dict(src, tmp_path / "ok", tag="outside")  # the real one converts
    assert torch.load(tmp_path / "ok" / "pytorch_model.bin", weights_only=True)["frozen.weight"].shape == (12, 12)
