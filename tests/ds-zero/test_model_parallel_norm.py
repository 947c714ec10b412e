"""The model-parallel gradient-norm rule (``ds_zero.grad_norm``): which parameters count (DeepSpeed's
``get_grad_norm``: not a tied weight's non-owner copy; on tensor-slice ranks > 0 only sliced parameters), the
tensor-parallel rank of an mpu, and ZeRO-1/2 leaving out the fragments of its flat partitions that do not count
(a left-out parameter split across two data-parallel partitions; still an overflow when it is inf)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_zero.collectives import TORCH
from ds_zero.grad_norm import (
    LOCAL,
    NormScope,
    counts_in_norm,
    norm_scope,
    partition_runs,
    partitioned_norm,
    tensor_model_parallel_rank,
)
from ds_zero.partition import FlatLayout


def _param(**attrs: bool) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(2))
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


def test_counts_in_norm_rule():
    slice1 = NormScope(tensor_mp_rank=1)
    assert counts_in_norm(_param(), LOCAL) and counts_in_norm(_param(ds_pipe_replicated=False), LOCAL)
    assert not counts_in_norm(_param(ds_pipe_replicated=True), LOCAL)
    assert not counts_in_norm(_param(), slice1)  # replicated across slices: slice 0 counts it
    assert counts_in_norm(_param(model_parallel=True), slice1)
    assert counts_in_norm(_param(tensor_model_parallel=True), slice1)
    assert not counts_in_norm(_param(model_parallel=False), slice1)
    assert not counts_in_norm(_param(ds_pipe_replicated=True, model_parallel=True), slice1)


class _Mpu:
    def __init__(self, **ranks: int) -> None:
        for name, rank in ranks.items():
            setattr(self, name, lambda rank=rank: rank)


def test_tensor_model_parallel_rank_follows_deepspeed_precedence():
    assert tensor_model_parallel_rank(None) == 0
    both = {"get_slice_parallel_rank": 2, "get_model_parallel_rank": 3}
    assert tensor_model_parallel_rank(_Mpu(get_tensor_model_parallel_rank=1, **both)) == 1
    assert tensor_model_parallel_rank(_Mpu(**both)) == 2
    assert tensor_model_parallel_rank(_Mpu(get_model_parallel_rank=3)) == 3
    with pytest.raises(TypeError, match="get_slice_parallel_rank"):
        tensor_model_parallel_rank(_Mpu())


def test_norm_scope_of_an_mpu():
    assert norm_scope(None) is LOCAL
    mpu = _Mpu(get_slice_parallel_rank=1)
    mpu.get_model_parallel_group = lambda: "group"
    scope = norm_scope(mpu)  # no process group initialised here: one rank
    assert (scope.group, scope.world_size, scope.tensor_mp_rank, scope.spans_ranks) == ("group", 1, 1, False)
    with pytest.raises(TypeError, match="get_model_parallel_group"):
        norm_scope(_Mpu(get_model_parallel_rank=0))


def test_partition_runs_split_counted_and_left_out_fragments():
    layout = FlatLayout([6, 10, 4], world_size=2)  # 20 elements, partitions of 10: tensor 1 spans both
    counts = [True, False, True]
    assert partition_runs(layout.fragments(0), counts) == ([(0, 6)], [(6, 4)])
    assert partition_runs(layout.fragments(1), counts) == ([(6, 4)], [(0, 6)])
    merged = FlatLayout([3, 3, 4], world_size=1)
    assert partition_runs(merged.fragments(0), [True, True, False]) == ([(0, 6)], [(6, 4)])


def test_partitioned_norm_left_out_pieces_only_flag_overflow():
    counted = [torch.tensor([3.0, 4.0])]
    assert partitioned_norm(counted, TORCH, None, 1, LOCAL, [torch.tensor([100.0])]) == 5.0
    assert math.isnan(partitioned_norm(counted, TORCH, None, 1, LOCAL, [torch.tensor([math.inf])]))
    assert math.isnan(partitioned_norm([], TORCH, None, 1, LOCAL, [torch.tensor([math.nan])]))


# ---- ZeRO-1/2 on two data-parallel ranks: a left-out parameter split across both partitions ---------------------
class _CountingComm:
    """``torch.distributed`` that records the group of every all-reduce."""

    def __init__(self) -> None:
        self.all_reduces: list = []

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.all_reduces.append(group)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def __getattr__(self, name: str):
        return getattr(TORCH, name)


def _zero_body(stage: int, scope_rank: int, mark: str, poison: bool, scope_world: int = 1) -> dict:
    from ds_zero.stage_1_and_2 import DeepSpeedZeroOptimizer, ZeroSettings

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (6, 10, 4)]  # partitions of 10: params[1] spans both
    setattr(params[1], mark, True)
    grads = [torch.randn(n) for n in (6, 10, 4)]
    before = [p.detach().clone() for p in params]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    settings = ZeroSettings(stage=stage, clip=0.5, check_overflow=True)
    comm = _CountingComm()
    group = dist.group.WORLD if scope_world == 2 else None
    scope = NormScope(group=group, world_size=scope_world, tensor_mp_rank=scope_rank)
    wrapper = DeepSpeedZeroOptimizer(torch.optim.SGD(params, lr=1.0), params, names, settings, comm=comm,
                                     norm_scope=scope)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    if poison:
        params[1].grad[-1] = math.inf  # in the second rank's partition only
    stepped = wrapper.step()
    return {"stepped": stepped, "norm": wrapper.global_grad_norm, "grads": grads, "before": before,
            "all_reduces": len(comm.all_reduces),
            "after": [p.detach().clone() for p in params]}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("scope_rank", "mark", "counted"), [(0, "ds_pipe_replicated", [0, 2]),
                                                             (1, "model_parallel", [1])])
def test_zero_leaves_out_fragments_that_do_not_count(stage, scope_rank, mark, counted):
    for r in run_distributed(_zero_body, world_size=2, args=(stage, scope_rank, mark, False), timeout=60):
        grads = r["grads"]
        expected = float(torch.linalg.vector_norm(torch.cat([grads[i] for i in counted])))
        assert r["stepped"] and r["norm"] == pytest.approx(expected, rel=1e-6)
        coef = 0.5 / (expected + 1e-6)
        for b, a, g in zip(r["before"], r["after"], grads, strict=True):
            torch.testing.assert_close(a, b - coef * g, rtol=1e-6, atol=1e-6)


def test_zero_left_out_inf_is_still_an_overflow():
    for r in run_distributed(_zero_body, world_size=2, args=(1, 0, "ds_pipe_replicated", True), timeout=60):
        assert not r["stepped"] and r["norm"] is None
        for b, a in zip(r["before"], r["after"], strict=True):
            assert torch.equal(a, b)


def test_zero_without_model_parallelism_keeps_its_one_all_reduce():
    plain = run_distributed(_zero_body, world_size=2, args=(1, 0, "unrelated_attribute", False), timeout=60)
    expected = float(torch.linalg.vector_norm(torch.cat(plain[0]["grads"])))
    assert [r["all_reduces"] for r in plain] == [1, 1]  # the data-parallel sum only
    assert [r["norm"] for r in plain] == [pytest.approx(expected, rel=1e-6)] * 2
    # a model-parallel group of 2 adds one sum over it (here the same two ranks: every square counted twice)
    spanned = run_distributed(_zero_body, world_size=2, args=(1, 0, "unrelated_attribute", False, 2), timeout=60)
    assert [r["all_reduces"] for r in spanned] == [2, 2]
    assert [r["norm"] for r in spanned] == [pytest.approx(expected * math.sqrt(2), rel=1e-6)] * 2
