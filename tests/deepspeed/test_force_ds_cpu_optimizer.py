"""``zero_force_ds_cpu_optimizer`` (default true) refuses a client torch optimizer with ``offload_optimizer``: the
error is a ``ConfigError`` naming the key and DeepSpeed's ``ZeRORuntimeException`` (what DeepSpeed's own tests
catch); false lets it through."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


def _init(force: bool) -> str:
    import deepspeed
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    from ds_config import ConfigError

    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_force_ds_cpu_optimizer": force,
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)
    except ZeRORuntimeException as exc:
        assert isinstance(exc, ConfigError)
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("force", [True, False])
def test_client_optimizer_with_offload(force):
    got = run_distributed(_init, world_size=1, args=(force,), timeout=60)[0]
    if force:
        assert "zero_force_ds_cpu_optimizer" in got and "Adam is not a DeepSpeed CPU optimizer" in got
    else:
        assert got == "accepted"
