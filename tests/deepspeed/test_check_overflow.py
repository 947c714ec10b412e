"""``deepspeed.runtime.utils.CheckOverflow`` with expert (MoE) parameters on 2 gloo ranks.

An inf in one rank's expert gradient must be seen on every rank of the expert-parallel group (DeepSpeed's
``TestCheckOverflow``): a rank that misses it steps while the others skip, and the replicas drift apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch._utils import _flatten_dense_tensors


def _params(inf_on_rank: int | None) -> list[torch.nn.Parameter]:
    shared = torch.nn.Parameter(torch.zeros(1))
    shared.grad = torch.ones(1)
    expert = torch.nn.Parameter(torch.zeros(1))
    expert.grad = torch.tensor([float("inf") if dist.get_rank() == inf_on_rank else 1.0])
    expert.allreduce = False  # an expert's parameter: each expert-parallel rank holds a different one
    return [shared, expert]


def _verdicts(inf_on_rank: int | None) -> dict[str, bool]:
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.utils import groups

    groups._create_expert_and_data_parallel(2)
    params = _params(inf_on_rank)
    checker = ds_utils.CheckOverflow([params])
    norm = ds_utils.get_weight_norm([_flatten_dense_tensors([p.grad for p in params])])
    return {
        "check": checker.check(),
        "check_groups_given": ds_utils.CheckOverflow().check([params]),
        "has_overflow": checker.has_overflow(params),
        "using_norm": checker.check_using_norm([norm], reduce_overflow=False),
    }


@pytest.mark.parametrize("inf_on_rank", [0, 1])
def test_inf_in_one_ranks_expert_is_seen_on_every_rank(inf_on_rank):
    results = run_distributed(_verdicts, world_size=2, args=(inf_on_rank,), timeout=60)
    for rank, verdicts in enumerate(results):
        assert verdicts == dict.fromkeys(verdicts, True), f"rank {rank}: {verdicts}"


def test_finite_gradients_are_no_overflow():
    results = run_distributed(_verdicts, world_size=2, args=(None,), timeout=60)
    for rank, verdicts in enumerate(results):
        assert verdicts == dict.fromkeys(verdicts, False), f"rank {rank}: {verdicts}"


def _without_expert_groups() -> str:
    from deepspeed.runtime.utils import CheckOverflow

    with pytest.raises(RuntimeError, match="no expert-parallel group exists") as err:
        CheckOverflow([_params(None)]).check()
    return str(err.value)


def test_expert_parameters_without_expert_groups_say_what_is_missing():
    messages = run_distributed(_without_expert_groups, world_size=2, timeout=60)
    assert "_create_expert_and_data_parallel" in messages[0]
