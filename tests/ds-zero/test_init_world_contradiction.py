"""``zero.Init`` refuses a single-rank process group when the launcher started several ranks (DeepSpeed #8084): a
size-1 group initialised early would leave every parameter whole on every rank, which looks like an OOM."""

from __future__ import annotations

import os

import torch
from _harness import run_distributed

from ds_zero.partition_parameters import _contradicting_single_rank_pg_error


def test_the_check_fires_only_for_a_launcher_world_against_a_one_rank_group():
    message = _contradicting_single_rank_pg_error(1, None, env={"WORLD_SIZE": "8"})
    assert message is not None and "WORLD_SIZE=8" in message and "init_distributed" in message
    assert _contradicting_single_rank_pg_error(1, None, env={"WORLD_SIZE": "1"}) is None
    assert _contradicting_single_rank_pg_error(1, None, env={}) is None
    assert _contradicting_single_rank_pg_error(8, None, env={"WORLD_SIZE": "8"}) is None
    assert _contradicting_single_rank_pg_error(1, object(), env={"WORLD_SIZE": "8"}) is None  # explicit: meant
    for bad in ("", "x", None):
        assert _contradicting_single_rank_pg_error(1, None, env={"WORLD_SIZE": bad}) is None


def _init_under_a_bigger_launcher() -> str:
    import deepspeed

    os.environ["WORLD_SIZE"] = "4"  # what a launcher of 4 ranks set, while this process's group has 1 rank
    try:
        with deepspeed.zero.Init():
            torch.nn.Linear(4, 4)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_zero_init_raises_before_building_anything():
    message = run_distributed(_init_under_a_bigger_launcher, world_size=1, timeout=60)[0]
    assert "world_size=1" in message and "WORLD_SIZE=4" in message


def _init_alone() -> bool:
    import deepspeed

    with deepspeed.zero.Init():
        layer = torch.nn.Linear(4, 4)
    return hasattr(layer.weight, "ds_id")


def test_a_real_single_process_run_is_fine():
    assert run_distributed(_init_alone, world_size=1, timeout=60)[0] is True
