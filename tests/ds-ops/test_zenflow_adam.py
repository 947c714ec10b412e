"""ZenFlow's selective AdamW (ds_ops.adam.zenflow_adam) against plain torch AdamW on the selected slice.

The reference for one parameter is ``torch.optim.AdamW`` (single-tensor path) on a standalone tensor that
holds the selected columns, fed the same gradients: the selected columns must equal it bitwise and every
other element must not move. The offload path (host moments, buckets) must equal the resident one bitwise.
"""

from __future__ import annotations

import pytest
import torch

from ds_ops.adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

HP = {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _stage3_param(weight: torch.Tensor, offset: int = 0) -> torch.nn.Parameter:
    """A ZeRO-3-style parameter whose partition holds the weight transposed, after ``offset`` other values."""
    param = torch.nn.Parameter(weight.clone())
    body = (weight.T if weight.dim() == 2 else weight).contiguous().view(-1)
    param.ds_tensor = torch.cat([torch.full((offset,), 7.0), body])
    param.ds_shape = (weight.shape[1], weight.shape[0]) if weight.dim() == 2 else tuple(weight.shape)
    param.complete_column_offset, param.complete_numel, param.group_id = offset, body.numel(), 0
    return param


def _columns(opt_cls, param: torch.Tensor) -> torch.Tensor:
    """The weight as (rows, columns) whatever the layout."""
    if opt_cls is ZenFlowSelectiveAdamW:
        return param.data
    off, n = param.complete_column_offset, param.complete_numel
    return param.ds_tensor[off:off + n].view(param.ds_shape).T


def _select(opt_cls, param: torch.Tensor, index: torch.Tensor, grad_cols: torch.Tensor) -> None:
    param.selected_indices = index
    param.selected_grad = grad_cols.clone() if opt_cls is ZenFlowSelectiveAdamW else grad_cols.T.contiguous()


def _make(opt_cls, weight: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(weight.clone()) if opt_cls is ZenFlowSelectiveAdamW else _stage3_param(weight, 5)


@pytest.mark.parametrize("opt_cls", [ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_selected_columns_follow_adamw_and_the_rest_stays(opt_cls, amsgrad):
    torch.manual_seed(0)
    weight = torch.randn(6, 8)
    index = torch.tensor([1, 4, 6])
    param = _make(opt_cls, weight)
    opt = opt_cls([param], amsgrad=amsgrad, **HP)
    ref = torch.nn.Parameter(weight[:, index].clone())
    ref_opt = torch.optim.AdamW([ref], amsgrad=amsgrad, foreach=False, **HP)
    for _ in range(4):
        grad = torch.randn(6, 3)
        _select(opt_cls, param, index, grad)
        ref.grad = grad.clone()
        opt.step()
        ref_opt.step()
        assert param.selected_grad is None and param.temp_selected_param is None
    cols = _columns(opt_cls, param)
    assert torch.equal(cols[:, index], ref.data)
    rest = [c for c in range(8) if c not in index.tolist()]
    assert torch.equal(cols[:, rest], weight[:, rest])
    assert opt.state[param]["step"].item() == 4
    if opt_cls is ZenFlowSelectiveAdamW_stage3:
        assert torch.equal(param.ds_tensor[:5], torch.full((5,), 7.0))  # outside the complete slice


@pytest.mark.parametrize("opt_cls", [ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3])
def test_update_starts_from_the_snapshot(opt_cls):
    """A full offloaded step that rewrote the parameter meanwhile must not erase the selected columns' value."""
    torch.manual_seed(1)
    weight = torch.randn(4, 5)
    index = torch.tensor([0, 3])
    param = _make(opt_cls, weight)
    opt = opt_cls([param], **HP)
    grad = torch.randn(4, 2)
    _select(opt_cls, param, index, grad)
    opt.temp_copy_param({0: [param]} if opt_cls is ZenFlowSelectiveAdamW else [param])
    _columns(opt_cls, param).mul_(0.0).add_(100.0)  # the "full step" overwrites everything
    opt.step()
    ref = torch.nn.Parameter(weight[:, index].clone())
    ref.grad = grad.clone()
    torch.optim.AdamW([ref], foreach=False, **HP).step()
    cols = _columns(opt_cls, param)
    assert torch.equal(cols[:, index], ref.data)
    assert torch.all(cols[:, [1, 2, 4]] == 100.0)


def _run(opt_cls, offload: bool, steps: int = 5):
    torch.manual_seed(2)
    weights = [torch.randn(5, 7), torch.randn(3, 4), torch.randn(9)]
    ks = [3, 2, 9]
    params = [_make(opt_cls, w) if w.dim() == 2 else torch.nn.Parameter(w.clone()) for w in weights]
    if opt_cls is ZenFlowSelectiveAdamW_stage3:
        params[2] = _stage3_param(weights[2])
        params[1].group_id = params[2].group_id = 1
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 1e-2, "amsgrad": True}]
    opt = opt_cls(groups, offload=offload, bucket_size=10, **HP)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p, w, k in zip(params, weights, ks, strict=True):
            if w.dim() == 1:
                p.selected_indices = torch.arange(k)
                p.selected_grad = torch.randn(w.shape, generator=gen)
                continue
            index = torch.randperm(w.shape[1], generator=gen)[:k]
            _select(opt_cls, p, index, torch.randn(w.shape[0], k, generator=gen))
        opt.step()
    moments = [(p.exp_avg_cpu_data, p.exp_avg_sq_cpu_data) if offload else
               (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]
    values = [p.data if opt_cls is ZenFlowSelectiveAdamW else p.ds_tensor for p in params]
    return values, moments, [opt.state[p]["step"].item() for p in params]


@pytest.mark.parametrize("opt_cls", [ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3])
def test_offload_and_resident_paths_agree_bitwise(opt_cls):
    v0, m0, s0 = _run(opt_cls, offload=False)
    v1, m1, s1 = _run(opt_cls, offload=True)
    assert s0 == s1 == [5, 5, 5]
    for a, b in zip(v0, v1, strict=True):
        assert torch.equal(a, b)
    for (a0, a1), (b0, b1) in zip(m0, m1, strict=True):
        assert torch.equal(a0, b0.view_as(a0)) and torch.equal(a1, b1.view_as(a1))
        assert a0.abs().sum() > 0


@pytest.mark.parametrize("opt_cls", [ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3])
@pytest.mark.parametrize("offload", [False, True])
def test_clear_selected_mv_zeroes_the_moments(opt_cls, offload):
    param = _make(opt_cls, torch.randn(2, 4))
    opt = opt_cls([param], offload=offload, **HP)
    _select(opt_cls, param, torch.tensor([1, 2]), torch.randn(2, 2))
    opt.step()
    m, v = (param.exp_avg_cpu_data, param.exp_avg_sq_cpu_data) if offload else \
        (opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"])
    assert m.abs().sum() > 0 and v.abs().sum() > 0
    opt.clear_selected_mv()
    assert m.abs().sum() == 0 and v.abs().sum() == 0


def test_group_step_updates_only_the_given_params():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3, 4))
    before_b = b.data.clone()
    opt = ZenFlowSelectiveAdamW([{"params": [a]}, {"params": [b], "lr": 0.5}], **HP)
    for p in (a, b):
        _select(ZenFlowSelectiveAdamW, p, torch.tensor([0]), torch.ones(3, 1))
    opt.group_step({0: [a]})
    assert a.selected_grad is None and b.selected_grad is not None
    assert torch.equal(b.data, before_b)


class _Swapper:
    """A stand-in for the NVMe partition swapper: storage keyed by parameter, placeholders in between."""

    def __init__(self, param):
        self.store, self.calls = param.ds_tensor.data.clone(), []
        param.ds_tensor.data = torch.zeros(())

    def swap_in(self, params, async_op=False):
        self.calls.append("in")
        params[0].ds_tensor.data = self.store.clone()

    def swap_out_and_release(self, params, async_op=False):
        self.calls.append("out")
        self.store = params[0].ds_tensor.data.clone()
        params[0].ds_tensor.data = torch.zeros(())

    def remove_partition_and_release_buffers(self, params):
        self.calls.append("drop")
        params[0].ds_tensor.data = torch.zeros(())


def test_nvme_partition_is_swapped_around_its_update():
    torch.manual_seed(4)
    weight = torch.randn(3, 6)
    resident, swapped = _stage3_param(weight), _stage3_param(weight)
    swapped.nvme_swapper = _Swapper(swapped)
    opt = ZenFlowSelectiveAdamW_stage3([resident, swapped], **HP)
    grad = torch.randn(3, 2)
    for p in (resident, swapped):
        _select(ZenFlowSelectiveAdamW_stage3, p, torch.tensor([2, 5]), grad)
    opt.temp_copy_param([swapped])
    assert swapped.nvme_swapper.calls == ["in", "drop"] and swapped.ds_tensor.data.dim() == 0
    opt.step()
    assert swapped.nvme_swapper.calls == ["in", "drop", "in", "out"] and swapped.ds_tensor.data.dim() == 0
    assert torch.equal(swapped.nvme_swapper.store, resident.ds_tensor)
    assert not torch.equal(resident.ds_tensor, weight.T.contiguous().view(-1))


def test_params_without_a_selection_are_skipped():
    a, b = torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(2, 3))
    before = b.data.clone()
    opt = ZenFlowSelectiveAdamW([a, b], offload=True, **HP)
    _select(ZenFlowSelectiveAdamW, a, torch.tensor([1]), torch.ones(2, 1))
    opt.step()
    assert torch.equal(b.data, before) and b not in opt.state


@pytest.mark.parametrize("bad", [0, -3, "big", True])
def test_bucket_size_is_checked(bad):
    with pytest.raises(ValueError, match=rf"bucket_size: must be a number of elements >= 1 \(got {bad!r}\)"):
        ZenFlowSelectiveAdamW([torch.nn.Parameter(torch.zeros(2))], offload=True, bucket_size=bad)
