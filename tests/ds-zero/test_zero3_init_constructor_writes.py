"""``zero.Init``: a constructor that initialises a child module's parameter after registering the child (torch's
``nn.MultiheadAttention`` zeroes ``out_proj.bias`` that way) writes the whole value, which is then partitioned
again; outside construction a write into a released parameter still fails with the guard's message."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

_CONFIG = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}


def _build() -> dict:
    import deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=_CONFIG):
        attn = torch.nn.MultiheadAttention(8, 2)
    with deepspeed.zero.GatheredParameters(list(attn.parameters())):
        values = {name: p.detach().clone() for name, p in attn.named_parameters()}
    with pytest.raises(RuntimeError, match="partitioned across ranks and not gathered"):
        torch.nn.init.zeros_(attn.out_proj.bias)
    return values


def test_constructor_writes_into_registered_children():
    ranks = run_distributed(_build, world_size=2, timeout=60)
    torch.manual_seed(0)
    plain = dict(torch.nn.MultiheadAttention(8, 2).named_parameters())
    for values in ranks:
        assert sorted(values) == sorted(plain)
        assert torch.count_nonzero(values["out_proj.bias"]) == 0 and torch.count_nonzero(values["in_proj_bias"]) == 0
        for name, value in values.items():  # rank 0's initial values, as the plain module draws them
            torch.testing.assert_close(value, plain[name].detach())
