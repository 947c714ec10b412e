"""FusedAdam / FusedLamb (torch fused and foreach kernels) on CPU, and on CUDA when present."""

from __future__ import annotations

import math

import pytest
import torch
from _ds_ops_optim_helpers import assert_rel_close, make_params, train_pair

from ds_ops import FusedAdam, FusedLamb


class PlainLamb(torch.optim.Optimizer):
    """LAMB written out per tensor in float64 scalars, as FusedLamb's docstring states it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
                 eps_inside_sqrt=False, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.cfg = dict(bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)

    @torch.no_grad()
    def step(self):
        cfg = self.cfg
        params = [p for g in self.param_groups for p in g["params"]]
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
        clip = (norm + 1e-6) / cfg["max_grad_norm"] if cfg["max_grad_norm"] > 0 else 0.0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
                grad = p.grad / clip if clip > 1 else p.grad
                st["m"] = beta1 * st["m"] + (1 - beta1) * grad
                st["v"] = beta2 * st["v"] + (1 - beta2) * grad * grad
                bc1 = 1 - beta1 ** st["step"] if cfg["bias_correction"] else 1.0
                bc2 = 1 - beta2 ** st["step"] if cfg["bias_correction"] else 1.0
                v_hat = st["v"] / bc2
                denom = (v_hat + group["eps"]).sqrt() if cfg["eps_inside_sqrt"] else v_hat.sqrt() + group["eps"]
                update = (st["m"] / bc1) / denom + group["weight_decay"] * p
                w_norm, u_norm = float(p.norm()), float(update.norm())
                ratio = 1.0
                if w_norm > 0 and u_norm > 0:
                    ratio = min(max(w_norm / u_norm, cfg["min_coeff"]), cfg["max_coeff"])
                p.add_(update, alpha=-group["lr"] * ratio)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch(adam_w_mode):
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    a, b, ours, _ = train_pair(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode),
                               lambda p: torch_cls(p, lr=1e-2, weight_decay=0.1), make_params())
    assert_rel_close(a, b)
    assert torch.is_tensor(ours.state[a[0]]["step"]) and float(ours.state[a[0]]["step"]) == 100


def test_fused_adam_without_bias_correction_and_state_dict_into_torch():
    from ds_ops import DeepSpeedCPUAdam

    a, b, _, _ = train_pair(lambda p: FusedAdam(p, lr=1e-2, bias_correction=False),
                            lambda p: DeepSpeedCPUAdam(p, lr=1e-2, bias_correction=False, allow_torch_fallback=True),
                            make_params(), steps=30)
    assert_rel_close(a, b)
    c, d, ours, theirs = train_pair(lambda p: FusedAdam(p, lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2,
                                                                                                weight_decay=0.0),
                                    make_params(), steps=3)
    theirs.load_state_dict(ours.state_dict())
    assert torch.equal(theirs.state[d[1]]["exp_avg"], ours.state[c[1]]["exp_avg"])


def test_fused_adam_rejects_amsgrad_and_zero_grad_sets_none():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        FusedAdam([p], amsgrad=True)
    p.grad = torch.ones(2)
    FusedAdam([p]).zero_grad()
    assert p.grad is None
    p.grad = torch.ones(2)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert torch.equal(p.grad, torch.zeros(2))


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_lamb_matches_plain_lamb(eps_inside_sqrt, bias_correction):
    kw = dict(lr=1e-2, weight_decay=0.01, eps_inside_sqrt=eps_inside_sqrt, bias_correction=bias_correction,
              max_grad_norm=1.0, max_coeff=5.0, min_coeff=0.05)
    a, b, ours, _ = train_pair(lambda p: FusedLamb(p, **kw), lambda p: PlainLamb(p, **kw),
                               make_params(sizes=(17, 1000, 3001)), steps=50)
    assert_rel_close(a, b)
    coeffs = ours.get_lamb_coeffs()
    assert len(coeffs) == 3 and all(0.05 <= c <= 5.0 for c in coeffs)


def test_fused_lamb_param_groups_and_errors():
    def groups(ps):
        return [{"params": ps[:1], "lr": 5e-3, "weight_decay": 0.1}, {"params": ps[1:], "betas": (0.8, 0.99)}]

    a, b, _, _ = train_pair(lambda g: FusedLamb(g, lr=1e-2), lambda g: PlainLamb(g, lr=1e-2),
                            make_params(sizes=(64, 300)), steps=30, groups=groups)
    assert_rel_close(a, b)
    with pytest.raises(ValueError, match="amsgrad"):
        FusedLamb([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    with pytest.raises(ValueError, match="min_coeff"):
        FusedLamb([torch.nn.Parameter(torch.ones(2))], min_coeff=2.0, max_coeff=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [FusedAdam, FusedLamb])
def test_fused_optimizers_on_cuda_match_cpu(cls):
    cpu = [torch.nn.Parameter(p) for p in make_params(sizes=(1000, 4097))]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opt_c, opt_g = cls(cpu, lr=1e-2, weight_decay=0.01), cls(gpu, lr=1e-2, weight_decay=0.01)
    for _ in range(20):
        for pc, pg in zip(cpu, gpu, strict=True):
            grad = torch.randn(pc.shape)
            pc.grad, pg.grad = grad, grad.cuda()
        opt_c.step()
        opt_g.step()
    assert_rel_close([p.cpu() for p in gpu], cpu, rel=1e-4)
