"""``deepspeed.runtime.utils`` as DeepSpeed 0.19 clients use it: partitioning, seeding, call strings, memory reports,
and the model-parallel norms and clipping (checked against ``torch.nn.utils.clip_grad_norm_`` on one rank and, on
2 gloo ranks with a Megatron-style tensor-parallel mpu, against torch on the whole model)."""

from __future__ import annotations

import math
import random

import numpy
import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

import deepspeed.runtime.utils as ds_utils
from deepspeed.runtime.utils import (
    CheckOverflow,
    DummyOptim,
    call_to_str,
    clip_grad_norm_,
    clip_tensors_by_global_norm,
    ensure_directory_exists,
    filter_empty_parameters,
    get_global_norm,
    get_global_norm_of_tensors,
    get_grad_norm,
    get_grad_zeros,
    get_weight_norm,
    is_model_parallel_parameter,
    mask_nan_or_inf_with_val_inplace,
    noop_context,
    noop_decorator,
    partition_balanced,
    partition_uniform,
    see_memory_usage,
    set_random_seed,
)


def _params_with_grads(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in ((4, 3), (3,), (2, 2, 2)):
        p = nn.Parameter(torch.randn(*shape, generator=g))
        p.grad = torch.randn(*shape, generator=g) * 3
        params.append(p)
    return params


# ---- small helpers -----------------------------------------------------------------------------------------------
def test_partitioning_is_ds_pipes_arithmetic():
    import ds_pipe.module

    assert partition_uniform is ds_pipe.module.partition_uniform
    assert partition_balanced is ds_pipe.module.partition_balanced
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([1] * 6, 3) == [0, 2, 4, 6]
    assert partition_balanced([1, 2, 3, 4], 2) == [0, 3, 4]  # 6 | 4 is more even than 3 | 7
    assert ds_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]


def test_call_to_str():
    assert call_to_str("LoadMicroBatch", buffer_id=1) == "LoadMicroBatch(buffer_id=1)"
    assert call_to_str("f", 1, "a", x=None) == "f(1, 'a', x=None)"
    assert call_to_str("g", 2) == "g(2)"
    assert call_to_str("h") == "h()"


def test_set_random_seed_seeds_every_generator():
    draws = []
    for _ in range(2):
        set_random_seed(1234)
        draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    set_random_seed(2**70 + 5)  # DeepSpeed takes the seed modulo each generator's range
    assert numpy.random.get_state()[1][0] == numpy.random.RandomState((2**70 + 5) % 2**32).get_state()[1][0]


def test_small_helpers(tmp_path):
    target = tmp_path / "a" / "b" / "ckpt.pt"
    ensure_directory_exists(str(target))
    assert target.parent.is_dir() and not target.exists()
    ensure_directory_exists("bare_name.txt")  # no directory part: nothing to create
    with noop_context():
        pass

    def f(x):
        return x

    assert noop_decorator(f) is f
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(0))]
    assert ds_utils.move_to_device([torch.ones(1), 3], "cpu")[1] == 3
    assert DummyOptim(params).param_groups == [{"params": params}]
    assert ds_utils.is_optimized_parameter(params[0]) and not ds_utils.is_optimized_parameter(params[1])
    params[0].ds_numel = 0  # a ZeRO-3 parameter counts by its full size
    assert not ds_utils.is_optimized_parameter(params[0])
    del params[0].ds_numel
    assert filter_empty_parameters(params) == [params[0]]
    assert filter_empty_parameters([{"params": params, "lr": 1.0}, {"params": [params[1]]}]) == [
        {"params": [params[0]], "lr": 1.0}]
    assert ds_utils.get_only_unique_item([3, 3]) == 3
    with pytest.raises(RuntimeError, match="only one unique element"):
        ds_utils.get_only_unique_item([1, 2])
    assert ds_utils.get_tensor_bytes({"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.float16)]}) == 16
    padded = ds_utils.align_dense_tensors([torch.ones(3), torch.ones(2)], 4)
    assert [t.numel() for t in padded] == [3, 2, 3]
    assert ds_utils.copy_to_device({"x": [torch.ones(1)], "n": 1}, "cpu", torch.is_tensor)["n"] == 1


def test_bwc_and_version_helpers_are_the_shared_ones():
    from deepspeed.utils import groups
    from deepspeed.utils.torch import required_torch_version

    assert ds_utils.bwc_tensor_model_parallel_rank is groups.bwc_tensor_model_parallel_rank
    assert ds_utils.required_torch_version is required_torch_version

    class Megatron:
        def get_tensor_model_parallel_rank(self):
            return 3

    assert ds_utils.bwc_tensor_model_parallel_rank(Megatron()) == 3
    assert ds_utils.bwc_tensor_model_parallel_rank(None) == 0


def test_is_model_parallel_parameter():
    p = nn.Parameter(torch.zeros(2))
    assert not is_model_parallel_parameter(p)
    p.tensor_model_parallel = True
    assert is_model_parallel_parameter(p)
    q = nn.Parameter(torch.zeros(2))
    q.model_parallel = False
    assert not is_model_parallel_parameter(q)


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("after setup", force=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "after setup"
    assert out[1].startswith("MA ") and "Max_MA" in out[1] and "CA" in out[1]
    assert out[2].startswith("CPU Virtual Memory:  used = ") and out[2].endswith("%")
    ds_utils.empty_cache()
    assert ds_utils.get_ma_status() > 0  # the CPU accelerator reports this process's resident set
    ds_utils.memory_status("probe")
    assert "MEMSTATS probe" in capsys.readouterr().out


# ---- norms and clipping against torch ----------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", [2, 1, 3.5, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    ours, theirs = _params_with_grads(), _params_with_grads()
    norm = clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, expected.float(), rtol=1e-6, atol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_single_tensor_and_no_grads():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm_(p, 1.0).item() == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([3.0, 4.0, 0.0]) / (5.0 + 1e-6))
    assert clip_grad_norm_([nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0


def test_clip_grad_norm_of_a_sparse_embedding_gradient():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 4])).sum().backward()
    dense = emb.weight.grad.to_dense()
    assert get_grad_norm(emb.parameters()) == pytest.approx(dense.norm().item(), rel=1e-6)
    norm = clip_grad_norm_(emb.parameters(), 0.1)
    assert norm.item() == pytest.approx(dense.norm().item(), rel=1e-6)
    assert emb.weight.grad.is_sparse
    torch.testing.assert_close(emb.weight.grad.to_dense(), dense * (0.1 / (norm + 1e-6)))


def test_grad_and_weight_norms():
    params = _params_with_grads()
    flat_grads = torch.cat([p.grad.flatten() for p in params])
    flat_data = torch.cat([p.data.flatten() for p in params])
    assert get_grad_norm(params) == pytest.approx(flat_grads.norm().item(), rel=1e-6)
    assert get_grad_norm(params, norm_type=math.inf) == pytest.approx(flat_grads.abs().max().item())
    assert get_weight_norm(params, norm_type=1) == pytest.approx(flat_data.abs().sum().item(), rel=1e-6)
    assert get_global_norm([3.0, 4.0]) == 5.0
    assert get_global_norm([torch.tensor(6.0), torch.tensor(8.0)]) == 10.0
    assert get_global_norm([3.0, -1]) == math.inf  # the -1 overflow marker is never squared into a norm
    assert ds_utils.combine_grad_norm_groups([3.0, 4.0]).item() == pytest.approx(5.0)
    assert ds_utils.combine_grad_norm_groups([torch.tensor(3.0), -1]).item() == math.inf
    assert ds_utils.is_invalid_grad_norm(torch.tensor([1.0, math.nan])) and not ds_utils.is_invalid_grad_norm(2.0)
    params[0].grad[0, 0] = math.inf
    assert get_grad_norm(params) == -1
    params[1].grad.zero_()
    assert get_grad_zeros(params) == 3.0


def test_replicated_tied_copy_is_not_counted():
    params = _params_with_grads()
    params[2].ds_pipe_replicated = True
    expected = torch.cat([p.grad.flatten() for p in params[:2]]).norm().item()
    assert get_grad_norm(params) == pytest.approx(expected, rel=1e-6)


def test_norm_of_tensors_and_clip_by_global_norm():
    tensors = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    norm = get_global_norm_of_tensors(tensors)
    assert norm.item() == pytest.approx(5.0)
    clip_tensors_by_global_norm(tensors, max_norm=1.0, global_norm=norm)
    assert torch.cat(tensors).norm().item() == pytest.approx(1.0, rel=1e-5)
    assert get_global_norm_of_tensors([torch.tensor([math.nan])]).item() == -1.0
    marked = torch.tensor([1.0, math.inf, math.nan])
    mask_nan_or_inf_with_val_inplace(marked)
    assert marked.tolist() == [1.0, -1.0, -1.0]


def test_check_overflow_one_process():
    params = _params_with_grads()
    checker = CheckOverflow([params])
    assert checker.check() is False
    params[1].grad[0] = math.nan
    assert checker.check() is True
    assert checker.has_overflow([params[0]]) is False
    assert bool(CheckOverflow._has_inf_or_nan(torch.tensor([1.0, -math.inf]), 0))
    flag = ds_utils.has_inf_or_nan(torch.tensor([1.0, math.nan]))
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and bool(flag)
    assert not bool(ds_utils.has_inf_or_nan(torch.zeros(0)))
    assert checker.check_using_norm([1.0, -1]) is True
    assert checker.check_using_norm([math.inf]) is True
    assert checker.check_using_norm([1.0, 2.0]) is False


# ---- model parallel: 2 tensor-slice ranks ------------------------------------------------------------------------
class TensorMpu:
    """A Megatron-style mpu: both ranks are one tensor-parallel (model-parallel) group, data parallelism 1."""

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_model_parallel_rank(self):
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        return dist.get_world_size()


def _whole_model_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(8, 3, generator=g), "b": torch.randn(3, generator=g), "e": torch.randn(5, generator=g)}


def _rank_params() -> list[nn.Parameter]:
    """This rank's view: a row slice of ``w`` (model parallel), ``b`` replicated, and the tied ``e`` held by
    both ranks, its rank-1 copy marked replicated."""
    rank, full = dist.get_rank(), _whole_model_grads()
    w = nn.Parameter(torch.zeros(4, 3))
    w.model_parallel = True
    w.grad = full["w"][4 * rank:4 * (rank + 1)].clone()
    b = nn.Parameter(torch.zeros(3))
    b.grad = full["b"].clone()
    e = nn.Parameter(torch.zeros(5))
    e.grad = full["e"].clone()
    e.ds_pipe_replicated = rank == 1
    return [w, b, e]


def _model_parallel_body(norm_type: float, max_norm: float) -> dict:
    from deepspeed.utils import groups

    groups.register_mpu(None)  # data parallelism of the norm average = the world (both ranks agree anyway)
    mpu = TensorMpu()
    params = _rank_params()
    out = {"grad_norm": get_grad_norm(params, norm_type, mpu=mpu), "zeros": get_grad_zeros(params, mpu=mpu)}
    out["norm"] = clip_grad_norm_(params, max_norm, norm_type=norm_type, mpu=mpu)
    out["grads"] = [p.grad for p in params]
    poisoned = _rank_params()
    if dist.get_rank() == 1:
        poisoned[0].grad[0, 0] = math.inf
    out["overflow"] = CheckOverflow([poisoned], mpu=mpu).check()
    out["norm_overflow"] = CheckOverflow(mpu=mpu).check_using_norm([-1 if dist.get_rank() == 0 else 1.0])
    return out


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_across_tensor_slices(norm_type):
    max_norm = 0.7
    results = run_distributed(_model_parallel_body, world_size=2, args=(norm_type, max_norm), timeout=60)
    full = _whole_model_grads()
    whole = [nn.Parameter(torch.zeros_like(t)) for t in full.values()]
    for p, g in zip(whole, full.values(), strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(whole, max_norm, norm_type=norm_type)
    w, b, e = (p.grad for p in whole)
    for rank, out in enumerate(results):
        assert out["grad_norm"] == pytest.approx(expected.item(), rel=1e-6)
        torch.testing.assert_close(out["norm"], expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["grads"][0], w[4 * rank:4 * (rank + 1)], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out["grads"][1], b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out["grads"][2], e, rtol=1e-6, atol=1e-7)
        assert out["zeros"] == 0.0
        assert out["overflow"] is True and out["norm_overflow"] is True
