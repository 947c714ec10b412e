"""``offload_optimizer: {device: cpu}`` with stages 1/2: where the states live, ``zero_force_ds_cpu_optimizer``,
and a client torch optimizer stepping the CPU partitions when that check is off."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_config import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _config(stage: int, **extra) -> dict:
    return {**BASE, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}, **extra}


def _client_optimizer_body(stage: int, steps: int) -> dict:
    import deepspeed

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=_config(stage, zero_force_ds_cpu_optimizer=False))
    gen = torch.Generator().manual_seed(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(steps):
        x, y = torch.randn(2 * world, 6, generator=gen), torch.randn(2 * world, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
    opt = engine.optimizer
    states = [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {"state": {k: v.clone() for k, v in engine.module.state_dict().items()},
            "inner": type(opt.optimizer).__name__,
            "devices": sorted({str(t.device) for t in [*(fg.master for fg in opt.groups), *states]})}


def _reference(steps: int, world: int) -> dict:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(2 * world, 6, generator=gen), torch.randn(2 * world, 3, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("stage", [1, 2])
def test_client_torch_optimizer_steps_the_cpu_partitions_when_allowed(stage):
    results = run_distributed(_client_optimizer_body, world_size=2, args=(stage, 8), timeout=60)
    ref = _reference(8, 2)
    for r in results:
        assert r["inner"] == "AdamW" and r["devices"] == ["cpu"]
        for key, value in ref.items():
            assert torch.allclose(r["state"][key], value, rtol=1e-5, atol=1e-7), key


def _forced_body() -> str:
    import deepspeed

    model = _model()
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                             config=_config(2))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_torch_optimizer_with_offload_needs_zero_force_ds_cpu_optimizer_false():
    message = run_distributed(_forced_body, world_size=1, timeout=60)[0]
    assert "zero_force_ds_cpu_optimizer" in message and "AdamW" in message and "DeepSpeedCPUAdam" in message


def _config_optimizer_body() -> tuple[str, str]:
    import deepspeed

    config = _config(1, optimizer={"type": "Adam", "params": {"lr": 0.01}})
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    return type(engine.optimizer.optimizer).__name__, str(engine.optimizer.groups[0].master.device)


def test_the_config_optimizer_becomes_deepspeed_cpu_adam():
    assert run_distributed(_config_optimizer_body, world_size=1, timeout=60)[0] == ("DeepSpeedCPUAdam", "cpu")


def _torch_adam_body(stage: int) -> str:
    import deepspeed

    config = _config(stage, optimizer={"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}})
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    engine.backward(engine(torch.randn(2, 6)).sum())
    engine.step()
    inner = engine.optimizer.optimizer
    return type(getattr(inner, "optimizer", inner)).__name__


@pytest.mark.parametrize("stage", [1, 3])
def test_the_config_optimizer_with_torch_adam_is_not_refused(stage):
    """As DeepSpeed: ``zero_force_ds_cpu_optimizer`` guards a client's optimizer; ``torch_adam: true`` in the
    config's own section asks for torch's Adam on the offloaded states on purpose."""
    assert run_distributed(_torch_adam_body, world_size=1, args=(stage,), timeout=60)[0] in ("Adam", "AdamW")


def _shared_groups_body(save_dir: str) -> dict:
    """Accelerate's offload mapping: DeepSpeedCPUAdam built over a torch optimizer's param-group dicts, and the
    user's LR schedule built on that torch optimizer."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = _model()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(torch_opt.param_groups, lr=0.1),
                                           config=_config(2))

    def step():
        engine.backward(engine(torch.ones(2, 6)).sum())
        engine.step()
        schedule.step()

    step()
    engine.save_checkpoint(save_dir, tag="t")
    engine.load_checkpoint(save_dir, tag="t")
    step()
    return {"engine": engine.get_lr(), "schedule": schedule.get_last_lr(),
            "shared": schedule.optimizer.param_groups[0] is engine.basic_optimizer.param_groups[0]}


def test_loading_keeps_the_param_groups_a_schedule_drives(tmp_path):
    result = run_distributed(_shared_groups_body, world_size=1, args=(str(tmp_path),), timeout=60)[0]
    assert result == {"engine": [0.025], "schedule": [0.025], "shared": True}
