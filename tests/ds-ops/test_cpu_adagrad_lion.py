"""DeepSpeedCPUAdagrad vs torch.optim.Adagrad and DeepSpeedCPULion vs a plain Lion, plus their state_dicts."""

from __future__ import annotations

import pytest
import torch
from _ds_ops_optim_helpers import BIG, assert_rel_close, make_params, train_pair

from ds_ops import DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion


class PlainLion(torch.optim.Optimizer):
    """Lion as written in the paper (Chen et al. 2023, Algorithm 2), one tensor at a time."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (beta1 * m + (1 - beta1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad_matches_torch_100_steps(native, weight_decay):
    a, b, _, _ = train_pair(lambda p: DeepSpeedCPUAdagrad(p, lr=1e-2, weight_decay=weight_decay),
                            lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=weight_decay), make_params())
    assert_rel_close(a, b)


def test_adagrad_groups_threads_and_state_dict_interop(native):
    def groups(ps):
        return [{"params": ps[:1], "lr": 0.05, "eps": 1e-6}, {"params": ps[1:], "weight_decay": 0.01}]

    a, b, ours, theirs = train_pair(lambda g: DeepSpeedCPUAdagrad(g), lambda g: torch.optim.Adagrad(g),
                                    make_params(sizes=BIG), steps=10, groups=groups)
    assert_rel_close(a, b)
    assert "sum" in ours.state[a[0]] and isinstance(ours.state[a[0]]["step"], int)
    # torch's state loads into ours (tensor step, 'sum') and ours into torch
    ours.load_state_dict(theirs.state_dict())
    assert ours.state[a[0]]["step"] == 10
    theirs.load_state_dict(ours.state_dict())
    assert torch.is_tensor(theirs.state[b[0]]["step"])


def test_adagrad_accepts_deepspeed_state_names(native):
    p = torch.nn.Parameter(torch.ones(3))
    opt = DeepSpeedCPUAdagrad([p])
    opt.load_state_dict({"state": {0: {"step": 4, "exp_avg_sq": torch.full((3,), 2.0)}},
                         "param_groups": [{"params": [0], "lr": 0.5, "eps": 1e-10, "weight_decay": 0,
                                           "amsgrad": False}]})
    assert torch.equal(opt.state[p]["sum"], torch.full((3,), 2.0)) and opt.param_groups[0]["lr"] == 0.5


def test_adagrad_rejects_amsgrad_and_lr_decay(native):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([p], amsgrad=True)
    opt = DeepSpeedCPUAdagrad([p])
    opt.param_groups[0]["lr_decay"] = 0.1
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="lr_decay=0.1"):
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_matches_plain_lion_100_steps(native, weight_decay):
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    a, b, _, _ = train_pair(lambda p: DeepSpeedCPULion(p, **kw), lambda p: PlainLion(p, **kw), make_params())
    assert_rel_close(a, b)


def test_lion_threads_groups_and_fused_lion(native):
    def groups(ps):
        return [{"params": ps[:1], "lr": 3e-4, "betas": (0.95, 0.98)}, {"params": ps[1:], "weight_decay": 0.2}]

    a, b, ours, _ = train_pair(lambda g: DeepSpeedCPULion(g), lambda g: PlainLion(g, betas=(0.9, 0.999)),
                               make_params(sizes=BIG), steps=10, groups=groups)
    assert_rel_close(a, b)
    assert ours.state[a[0]]["step"] == 10
    c, d, _, _ = train_pair(lambda p: FusedLion(p, weight_decay=0.1), lambda p: PlainLion(p, betas=(0.9, 0.999),
                                                                                          weight_decay=0.1),
                            make_params(), steps=50)
    assert_rel_close(c, d)


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdagrad, DeepSpeedCPULion])
def test_bf16_params_and_fused_copy(native, cls):
    ps = [torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))]
    ps[0].grad = torch.randn(1000).to(torch.bfloat16)
    opt = cls(ps, fp32_optimizer_states=False)
    opt.step()
    state_key = "sum" if cls is DeepSpeedCPUAdagrad else "exp_avg"
    assert opt.state[ps[0]][state_key].dtype == torch.bfloat16
    master = [torch.nn.Parameter(torch.randn(1000))]
    master[0].grad = torch.randn(1000)
    buf = torch.empty(1000, dtype=torch.float16)
    cls(master).step(fp16_param_groups=[[buf]])
    assert torch.equal(buf, master[0].detach().half())
