"""``ds_zero.offload_states``: moving a ZeRO stage 1/2 optimizer's states off the device and back, through
``deepspeed.initialize`` on gloo ranks. Training after offload + reload must continue bit-identically to a
run that never offloaded. On a CPU-only machine offloading to the CPU moves nothing, so the CPU tests force a
copy (``_Transfer(copy=True)``): every buffer really gets new storage and every view must be re-pointed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN, HID, OUT = 6, 12, 3
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}
ALL = ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def make_config(stage: int, precision: str = "fp32", gas: int = 1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "optimizer": ADAMW,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000, **extra}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def micro_step(engine, seed: int, device: str = "cpu") -> None:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x, y = torch.randn(2, IN, generator=gen).to(device), torch.randn(2, OUT, generator=gen).to(device)
    dtype = next(engine.module.parameters()).dtype
    engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
    engine.step()


def snapshot(engine) -> dict:
    """Everything training state-wise: weights, fp32 masters, optimizer states (cloned)."""
    opt = engine.optimizer
    out = {f"w.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    for g, fg in enumerate(opt.groups):
        out[f"master.{g}"] = fg.master.detach().clone()
        for key, value in opt.optimizer.state[fg.master].items():
            out[f"state.{g}.{key}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
    return out


def storages(engine) -> dict:
    """Where each offloadable buffer lives now (data pointers)."""
    opt = engine.optimizer
    return {"lp": [fg.lp_flat.data_ptr() for fg in opt.groups],
            "params": [p.data_ptr() for fg in opt.groups for p in fg.params],
            "hp": [fg.master.data_ptr() for fg in opt.groups],
            "grads": [fg.grad_partition.data_ptr() for fg in opt.groups],
            "buckets": [t.data_ptr() for t in opt.reducer.buffers()],
            "optim": [v.data_ptr() for fg in opt.groups for v in opt.optimizer.state[fg.master].values()
                      if torch.is_tensor(v) and v.dim() > 0]}


def assert_views_are_repointed(engine) -> None:
    for fg in engine.optimizer.groups:
        base = fg.lp_flat.untyped_storage().data_ptr()
        assert fg.lp_partition.untyped_storage().data_ptr() == base
        for p, offset in zip(fg.params, fg.layout.offsets, strict=True):
            assert p.untyped_storage().data_ptr() == base
            assert p.data_ptr() == fg.lp_flat[offset:].data_ptr()


# ---- bit-identical continuation (CPU, forced copies) ----------------------------------------------------------
def _continuation_body(stage: int, precision: str, gas: int, include: list[str] | None, extra: dict) -> dict:
    import deepspeed
    from ds_zero.offload_states import OffloadStateTypeEnum, _offload, _reload, _Transfer, get_state_devices

    config = make_config(stage, precision, gas, **extra)
    moved, plain = (deepspeed.initialize(model=make_model(0), config=config)[0] for _ in range(2))
    for seed in range(2 * gas + 1):  # ends inside an accumulation window when gas > 1
        micro_step(moved, seed)
        micro_step(plain, seed)
    states = [OffloadStateTypeEnum(s) for s in (include or ALL)]
    values, before = snapshot(moved), storages(moved)
    _offload(moved.optimizer, states, torch.device("cpu"), _Transfer(copy=True))
    after = storages(moved)
    owner = {"lp": "lp_params", "params": "lp_params", "hp": "hp_params", "grads": "lp_grads",
             "buckets": "contiguous_grad_buffer", "optim": "optim_states"}
    for key, state in owner.items():
        changed = [a != b for a, b in zip(after[key], before[key], strict=True)]
        assert all(changed) if state in states else not any(changed), f"{key}: {changed}"
        assert get_state_devices(moved, state) <= {torch.device("cpu")}
    assert_views_are_repointed(moved)
    assert all(torch.equal(v, snapshot(moved)[k]) for k, v in values.items())
    _reload(moved.optimizer, _Transfer(copy=True))
    assert all(a != b for key in after for a, b in zip(storages(moved)[key], after[key], strict=True)
               if owner[key] in states)
    assert_views_are_repointed(moved)
    for seed in range(2 * gas + 1, 4 * gas):
        micro_step(moved, seed)
        micro_step(plain, seed)
    got, want = snapshot(moved), snapshot(plain)
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"training diverged after offload/reload in {different}"
    return {"steps": moved.global_steps}


@pytest.mark.parametrize(("stage", "world", "precision", "gas", "include", "extra"), [
    (1, 2, "fp32", 1, None, {}),
    (2, 2, "fp32", 2, None, {}),  # between micro steps: the gradient partitions hold a half-window's sum
    (2, 2, "bf16", 1, ["hp_params", "optim_states"], {}),  # the spec's example: only some states move
    (1, 2, "bf16", 2, ["lp_grads", "lp_params"], {"data_types": {"grad_accum_dtype": "fp32"}}),
    (2, 1, "fp32", 1, None, {}),
    (2, 2, "fp32", 1, None, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                             "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}),
])
def test_offload_reload_continues_bit_identically(stage, world, precision, gas, include, extra):
    results = run_distributed(_continuation_body, world_size=world, args=(stage, precision, gas, include, extra),
                              timeout=60)
    assert [r["steps"] for r in results] == [4] * world


# ---- the public API, devices and errors -------------------------------------------------------------------------
def _api_body() -> dict:
    import deepspeed
    from ds_zero.offload_states import (
        OffloadDeviceEnum,
        OffloadStateTypeEnum,
        get_state_devices,
        offload_states,
        reload_states,
    )

    cpu = torch.device("cpu")
    engine = deepspeed.initialize(model=make_model(0), config=make_config(2))[0]
    assert get_state_devices(engine, OffloadStateTypeEnum.optim_states) == set()  # no step yet: no state
    assert get_state_devices(engine, "contiguous_grad_buffer") == {cpu}
    for state in ("hp_params", "lp_params", "lp_grads"):
        assert get_state_devices(engine, state) == {cpu}
        assert get_state_devices(engine.optimizer, state) == {cpu}  # the optimizer itself works too
    micro_step(engine, 0)
    assert get_state_devices(engine, OffloadStateTypeEnum.optim_states) == {cpu}
    before = snapshot(engine)
    engine.offload_states(include=[OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states])
    engine.reload_states()
    offload_states(engine.optimizer, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
    offload_states(engine.optimizer, include="lp_params", device="cpu")  # twice: keeps the first devices
    reload_states(engine.optimizer, non_blocking=True)
    reload_states(engine.optimizer)  # nothing left to reload
    assert all(torch.equal(v, snapshot(engine)[k]) for k, v in before.items())

    errors = {}
    for name, call in {
        "nvme": lambda: offload_states(engine, device=OffloadDeviceEnum.nvme),
        "none": lambda: offload_states(engine, device="none"),
        "cuda": lambda: offload_states(engine, device="cuda"),
        "include": lambda: offload_states(engine, include=["hp_params", "activations"]),
        "state": lambda: get_state_devices(engine, "weights"),
        "type": lambda: offload_states(torch.optim.SGD(make_model(0).parameters(), lr=0.1)),
    }.items():
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        errors[name] = str(info.value)
    stage0 = deepspeed.initialize(model=make_model(0), config={**make_config(0)})[0]
    with pytest.raises(TypeError, match="whose optimizer is"):
        get_state_devices(stage0, "hp_params")
    lazy = deepspeed.initialize(model=make_model(0), config=make_config(
        2, zero_optimization={"stage": 2, "contiguous_gradients": False}))[0]
    assert get_state_devices(lazy, "contiguous_grad_buffer") == set()  # allocated only while reducing
    return errors


def test_public_api_devices_and_errors():
    errors = run_distributed(_api_body, world_size=1, timeout=60)[0]
    assert "NVMe is not supported" in errors["nvme"] and "accepted: 'cpu'" in errors["nvme"]
    assert "'none' means no offload" in errors["none"]
    assert "unknown device" in errors["cuda"]
    assert "'activations'" in errors["include"] and "contiguous_grad_buffer" in errors["include"]
    assert "unknown state 'weights'" in errors["state"]
    assert "expected a ZeRO optimizer" in errors["type"] and "got SGD" in errors["type"]


def _guard_body(save_dir: str) -> dict:
    """On the CPU nothing really moves, so the states are made to look as if they came from another device
    (the records offload_states keeps); the real move is checked in the CUDA test below."""
    import deepspeed
    from ds_zero.offload_states import _RECORDS

    engine = deepspeed.initialize(model=make_model(0), config=make_config(2))[0]
    micro_step(engine, 0)
    engine.save_checkpoint(save_dir, tag="t")
    engine.offload_states(include=["optim_states", "hp_params"])
    micro_step(engine, 1)  # offloading to where the states already are moved nothing: training goes on
    records = _RECORDS[engine.optimizer]
    originals = {state: dict(seen) for state, seen in records.items()}
    for seen in records.values():
        for key, (holder, _) in seen.items():
            seen[key] = (holder, torch.device("meta"))
    x = torch.randn(2, IN)
    errors = {}
    for name, call in {"backward": lambda: engine.backward(engine(x).sum()), "step": engine.step,
                       "load_checkpoint": lambda: engine.load_checkpoint(save_dir, tag="t")}.items():
        with pytest.raises(RuntimeError) as info:
            call()
        errors[name] = str(info.value)
    records.update(originals)
    engine.reload_states()
    engine.load_checkpoint(save_dir, tag="t")
    micro_step(engine, 2)
    return {"errors": errors, "steps": engine.global_steps}


def test_training_and_loading_wait_for_reload(tmp_path):
    """A checkpoint loaded while offloaded would put new optimizer state beside the offloaded one, outside
    what reload_states moves back: while a state is off its device the engine refuses, and says so."""
    result = run_distributed(_guard_body, world_size=2, args=(str(tmp_path),), timeout=60)[0]
    for call, message in result["errors"].items():
        assert message.startswith(f"engine.{call}: the ZeRO states optim_states, hp_params were moved"), message
        assert "call engine.reload_states() first" in message
    assert result["steps"] == 2  # the checkpoint (1 step) plus one


# ---- the real move on a GPU ---------------------------------------------------------------------------------------
def _cuda_body(non_blocking: bool) -> dict:
    import deepspeed
    from ds_zero.debug import safe_get_full_fp32_param
    from ds_zero.offload_states import OffloadStateTypeEnum, get_state_devices

    config = make_config(2, "bf16")
    moved, plain = (deepspeed.initialize(model=make_model(0), config=config)[0] for _ in range(2))
    for seed in range(2):
        micro_step(moved, seed, "cuda")
        micro_step(plain, seed, "cuda")
    cuda, cpu = torch.device("cuda", torch.cuda.current_device()), torch.device("cpu")
    assert all(get_state_devices(moved, s) == {cuda} for s in OffloadStateTypeEnum)
    weight = moved.module[0].weight
    master = safe_get_full_fp32_param(weight)
    allocated = torch.cuda.memory_allocated()
    moved.offload_states(non_blocking=non_blocking)
    torch.cuda.synchronize()
    devices = {s.value: sorted(str(d) for d in get_state_devices(moved, s)) for s in OffloadStateTypeEnum}
    assert all(d == ["cpu"] for d in devices.values()), devices
    assert moved.optimizer.groups[0].master.is_pinned() and weight.is_pinned()
    freed = allocated - torch.cuda.memory_allocated()
    assert torch.equal(safe_get_full_fp32_param(weight).to(cuda), master)  # readable while offloaded
    with pytest.raises(RuntimeError, match="call engine.reload_states"):
        moved.step()  # (a forward would already fail: the weights are on the CPU)
    moved.reload_states(non_blocking=non_blocking)
    torch.cuda.synchronize()
    assert all(get_state_devices(moved, s) == {cuda} for s in OffloadStateTypeEnum) and weight.device == cuda
    assert_views_are_repointed(moved)
    for seed in range(2, 4):
        micro_step(moved, seed, "cuda")
        micro_step(plain, seed, "cuda")
    got, want = snapshot(moved), snapshot(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
    return {"freed": freed, "cpu": cpu.type}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("non_blocking", [False, True])
def test_cuda_offload_frees_device_memory_and_continues(non_blocking):
    r = run_distributed(_cuda_body, world_size=1, args=(non_blocking,), backend="nccl", timeout=120)[0]
    assert r["freed"] > 0
