"""Resuming across optimizer placements and the debug APIs on NVMe-swapped state, on 2 gloo ranks.

- A checkpoint saved with ``offload_optimizer: cpu`` (DeepSpeedCPUAdam) resumes with the optimizer in memory
  (FusedAdam, torch's fused kernel, which needs tensor ``step``s) and the other way round, continuing as the
  saving run continues.
- ``safe_get/set_full_fp32_param``, ``safe_get/set_full_optimizer_state`` and ``safe_get/set_full_grad`` read
  and write through the swapper
  when the parameter's sub-group lives on NVMe, and agree with the same run kept in memory.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _zero3_toy import GLOBAL, train_step
from _zero3_toy import INFINITY_ZERO as ZERO


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 12) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, hidden)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _engine(zero: dict, config_optimizer: bool = True, aio: dict | None = None):
    import deepspeed

    torch.manual_seed(0)
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
              "steps_per_print": 10**6, "zero_optimization": zero,
              "aio": aio or {"block_size": 4096, "queue_depth": 4}}
    model = Net()
    if config_optimizer:  # DeepSpeed's choice: DeepSpeedCPUAdam with offload_optimizer cpu, FusedAdam without
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.02}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    config["zero_force_ds_cpu_optimizer"] = False
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def _step(engine, step: int, grads: dict | None = None) -> float:
    """One training step; with ``grads``, reads every gradient between backward and step, then halves it."""
    if grads is None:
        return train_step(engine, step)

    def halve() -> None:
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        params = list(engine.module.parameters())
        grads["grad"] = [safe_get_full_grad(p).clone() for p in params]
        for p, g in zip(params, grads["grad"], strict=True):
            safe_set_full_grad(p, g * 0.5)
        grads["halved"] = [safe_get_full_grad(p).clone() for p in params]

    return train_step(engine, step, after_backward=halve)


def _cross(save_dir: str) -> dict:
    out = {}
    for name, save, load in (("cpu_to_memory", "cpu", "none"), ("memory_to_cpu", "none", "cpu")):
        first = _engine({**ZERO, "offload_optimizer": {"device": save}})
        out[f"{name}_save_opt"] = type(first.optimizer.optimizer).__name__
        [_step(first, s) for s in range(3)]
        first.save_checkpoint(save_dir, tag=name)
        out[f"{name}_expected"] = [_step(first, s) for s in range(3, 5)]
        first.destroy()
        second = _engine({**ZERO, "offload_optimizer": {"device": load}})
        out[f"{name}_load_opt"] = type(second.optimizer.optimizer).__name__
        second.load_checkpoint(save_dir, tag=name)
        out[f"{name}_resumed"] = [_step(second, s) for s in range(3, 5)]
        steps = {v["step"] if isinstance(v["step"], int) else float(v["step"])
                 for v in second.optimizer.optimizer.state.values()}
        out[f"{name}_steps"] = sorted(steps)
        second.destroy()
    return out


def test_checkpoint_moves_between_cpu_adam_and_fused_adam(tmp_path):
    for r in run_distributed(_cross, world_size=2, args=(str(tmp_path),), timeout=120):
        for name in ("cpu_to_memory", "memory_to_cpu"):
            pair = (r[f"{name}_save_opt"], r[f"{name}_load_opt"])
            assert pair == (("DeepSpeedCPUAdam", "FusedAdam") if name == "cpu_to_memory"
                            else ("FusedAdam", "DeepSpeedCPUAdam"))
            assert r[f"{name}_resumed"] == pytest.approx(r[f"{name}_expected"], rel=1e-5)
            assert r[f"{name}_steps"] == [5]  # the step count went on from the saved 3


def _nvme(path: str) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 12},
            "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0, "buffer_count": 3,
                              "buffer_size": 200}}


def _debug(path: str) -> dict:
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    out = {}
    for where, zero in (("memory", ZERO), ("nvme", {**ZERO, **_nvme(path)})):
        engine = _engine(zero, config_optimizer=False)
        if where == "nvme":
            out["swapped"] = len(engine.optimizer.swapped)
        loss0 = _step(engine, 0)
        params = list(engine.module.parameters())
        out[where] = {"loss0": loss0, "fp32": [safe_get_full_fp32_param(p).clone() for p in params],
                      "exp_avg_sq": [safe_get_full_optimizer_state(p, "exp_avg_sq").clone() for p in params]}
        for k, p in enumerate(params):  # new values; what the next step starts from
            safe_set_full_fp32_param(p, torch.full(tuple(p.ds_shape), 0.01 * (k + 1)))
            safe_set_full_optimizer_state(p, torch.full(tuple(p.ds_shape), 0.5), "exp_avg")
        out[where]["read_back"] = [safe_get_full_fp32_param(p).clone() for p in params]
        out[where]["exp_avg"] = [safe_get_full_optimizer_state(p, "exp_avg").clone() for p in params]
        out[where]["loss"] = [_step(engine, 1, grads=out[where]), _step(engine, 2)]
        engine.destroy()
    for ratio, size in ((0.3, 10**6), (0.5, 20), (0.0, 20)):  # DeepSpeed's count: the last ones, rounded up
        nvme = _nvme(path)
        nvme["offload_optimizer"]["ratio"] = ratio
        engine = _engine({**ZERO, **nvme, "sub_group_size": size}, config_optimizer=False)
        out[f"ratio{ratio}"] = (engine.optimizer.swapped, len(engine.optimizer.groups))
        out[f"ratio{ratio}_loss"] = _step(engine, 0)
        engine.destroy()
    return out


def test_debug_apis_read_and_write_through_nvme(tmp_path):
    for r in run_distributed(_debug, world_size=2, args=(str(tmp_path),), timeout=120):
        assert r["swapped"] >= 2
        mem, nvme = r["memory"], r["nvme"]
        for a, b in zip(nvme["grad"], nvme["halved"], strict=True):
            torch.testing.assert_close(b, a * 0.5)
        for key in ("fp32", "exp_avg_sq", "read_back", "exp_avg", "grad", "halved"):
            for a, b in zip(mem[key], nvme[key], strict=True):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for k, v in enumerate(nvme["read_back"]):
            assert torch.all(v == 0.01 * (k + 1))
        assert all(torch.all(v == 0.5) for v in nvme["exp_avg"])
        assert nvme["loss"] == pytest.approx(mem["loss"], rel=1e-6)
        assert r["ratio0.3"] == ([0], 1)  # one sub-group and ratio 0.3: it goes to NVMe (none did before)
        swapped, total = r["ratio0.5"]
        assert total >= 3 and swapped == list(range(total // 2, total))
        assert r["ratio0.0"][0] == []
        assert r["ratio0.3_loss"] == r["ratio0.5_loss"] == r["ratio0.0_loss"] == pytest.approx(mem["loss0"])
