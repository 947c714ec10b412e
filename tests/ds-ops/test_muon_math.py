"""Muon's math (ds_ops.muon) against straightforward float64 references: the quintic Newton-Schulz iteration
written out as a loop, its Gram form, the momentum/Nesterov/scaling of ``muon_update``, and the optimizers'
updates against the same formulas applied by hand."""

from __future__ import annotations

import pytest
import torch

from ds_ops.muon import (
    MuonWithAuxAdam,
    SingleDeviceMuon,
    SingleDeviceMuonWithAuxAdam,
    muon_update,
    zeropower_via_gram_newtonschulz,
    zeropower_via_newtonschulz5,
)
from ds_ops.muon.original import MuonWithAuxAdam as DistributedMuonWithAuxAdam

F64 = torch.float64


def reference_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration on one float64 matrix, as written in the Muon write-up."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(F64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_update(g: torch.Tensor, m: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    m = beta * m + (1 - beta) * g
    u = reference_ns((1 - beta) * g + beta * m)
    return u * max(1.0, g.shape[0] / g.shape[1]) ** 0.5, m


@pytest.mark.parametrize("shape", [(8, 8), (6, 20), (20, 6), (1, 9), (33, 7)])
@pytest.mark.parametrize("fn", [zeropower_via_newtonschulz5, zeropower_via_gram_newtonschulz])
def test_newton_schulz_matches_the_float64_loop(shape, fn):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=F64)
    ours = fn(g, 5, compute_dtype=F64)
    torch.testing.assert_close(ours, reference_ns(g), rtol=1e-9, atol=1e-9)
    # float32 (the CPU default) stays close to it
    torch.testing.assert_close(fn(g.float(), 5).to(F64), reference_ns(g), rtol=2e-4, atol=2e-4)


def test_newton_schulz_orthogonalises_keeping_the_singular_vectors():
    g = torch.randn(12, 30, generator=torch.Generator().manual_seed(1), dtype=F64)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    out = zeropower_via_newtonschulz5(g, compute_dtype=F64)
    core = u.T @ out @ vh.T  # diagonal: the iteration only maps singular values
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 1e-10
    assert 0.6 < torch.diagonal(core).min() and torch.diagonal(core).max() < 1.25


def test_newton_schulz_batches_and_keeps_zero_at_zero():
    g = torch.randn(3, 5, 9, generator=torch.Generator().manual_seed(2), dtype=F64)
    for fn in (zeropower_via_newtonschulz5, zeropower_via_gram_newtonschulz):
        batched = fn(g, compute_dtype=F64)
        for i in range(3):
            torch.testing.assert_close(batched[i], reference_ns(g[i]), rtol=1e-9, atol=1e-9)
        assert fn(torch.zeros(4, 6)).abs().max() == 0
    with pytest.raises(ValueError, match=r"matrix.*\(7,\)"):
        zeropower_via_newtonschulz5(torch.ones(7))


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_update_momentum_nesterov_and_scale(nesterov):
    gen = torch.Generator().manual_seed(3)
    g, m0 = torch.randn(18, 6, generator=gen, dtype=F64), torch.randn(18, 6, generator=gen, dtype=F64)
    m = m0.clone()
    g_before = g.clone()
    out = muon_update(g, m, beta=0.9, nesterov=nesterov, ns_method="standard", compute_dtype=F64)
    m_ref = 0.9 * m0 + 0.1 * g
    target = 0.1 * g + 0.9 * m_ref if nesterov else m_ref
    torch.testing.assert_close(m, m_ref)
    torch.testing.assert_close(out, reference_ns(target) * 3 ** 0.5, rtol=1e-9, atol=1e-9)  # 18/6 rows/cols
    assert torch.equal(g, g_before)  # the gradient is not overwritten


def test_muon_update_conv_filters_and_expert_groups():
    gen = torch.Generator().manual_seed(4)
    conv = torch.randn(4, 2, 3, 3, generator=gen, dtype=F64)
    out = muon_update(conv, torch.zeros_like(conv), beta=0.5, compute_dtype=F64)
    flat = conv.reshape(4, -1)
    torch.testing.assert_close(out.reshape(4, -1), reference_ns(0.5 * flat + 0.5 * 0.5 * flat), rtol=1e-9,
                               atol=1e-9)
    experts = torch.randn(3, 10, 4, generator=gen, dtype=F64)
    out = muon_update(experts, torch.zeros_like(experts), beta=0.0, is_expert_group=True, compute_dtype=F64)
    for e in range(3):
        torch.testing.assert_close(out[e], reference_ns(experts[e]) * 2.5 ** 0.5, rtol=1e-9, atol=1e-9)


def test_muon_update_rejects_bad_input():
    with pytest.raises(ValueError, match="ns_method='fast'.*gram"):
        muon_update(torch.ones(3, 3), torch.zeros(3, 3), ns_method="fast")
    with pytest.raises(ValueError, match=r"shape \(5,\).*use_muon = False"):
        muon_update(torch.ones(5), torch.zeros(5))
    with pytest.raises(ValueError, match="momentum of shape"):
        muon_update(torch.ones(3, 3), torch.zeros(3, 4))


def _groups(model: torch.nn.Sequential) -> list[dict]:
    return [{"params": [model[0].weight], "use_muon": True, "lr": 0.1, "weight_decay": 0.01, "momentum": 0.8,
             "ns_method": "standard"},
            {"params": [model[0].bias], "use_muon": False, "lr": 0.05, "weight_decay": 0.0}]


@pytest.mark.parametrize("cls", [SingleDeviceMuonWithAuxAdam, DistributedMuonWithAuxAdam, MuonWithAuxAdam])
def test_aux_adam_optimizers_follow_the_formulas(cls):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4)).double()
    w0, b0 = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    opt = cls(_groups(model))
    m = torch.zeros_like(w0)
    w, b = w0.clone(), b0.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(b0), torch.zeros_like(b0)
    for step in range(1, 4):
        opt.zero_grad()
        model(torch.randn(5, 6, dtype=F64)).square().sum().backward()
        gw, gb = model[0].weight.grad.clone(), model[0].bias.grad.clone()
        opt.step()
        m = 0.8 * m + 0.2 * gw
        w = w * (1 - 0.1 * 0.01) - 0.1 * reference_ns(0.2 * gw + 0.8 * m)
        exp_avg, exp_avg_sq = 0.9 * exp_avg + 0.1 * gb, 0.95 * exp_avg_sq + 0.05 * gb * gb
        b = b - 0.05 * (exp_avg / (1 - 0.9 ** step)) / ((exp_avg_sq / (1 - 0.95 ** step)).sqrt() + 1e-10)
        torch.testing.assert_close(model[0].weight.detach(), w, rtol=1e-5, atol=1e-5)  # float32 NS inside
        torch.testing.assert_close(model[0].bias.detach(), b, rtol=1e-9, atol=1e-12)


def test_precomputed_groups_apply_the_gradient_as_the_update():
    from ds_ops.muon import ORTHOGONALIZED

    p = torch.nn.Parameter(torch.ones(4, dtype=F64))  # a flat ZeRO partition
    opt = MuonWithAuxAdam([{"params": [p], "use_muon": True, "lr": 0.5, "weight_decay": 0.1}])
    opt.param_groups[0][ORTHOGONALIZED] = True
    p.grad = torch.arange(4, dtype=F64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.ones(4, dtype=F64) * 0.95 - 0.5 * torch.arange(4, dtype=F64))
    assert not opt.state[p]  # no state: ZeRO keeps the momentum


def test_groups_are_validated_with_clear_errors():
    w = torch.nn.Parameter(torch.ones(3, 3))
    with pytest.raises(ValueError, match="group 0 has no 'use_muon'"):
        MuonWithAuxAdam([{"params": [w]}])
    with pytest.raises(ValueError, match="group 0: ns_method='x'"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "ns_method": "x"}])
    with pytest.raises(ValueError, match="momentum=1.0"):
        MuonWithAuxAdam([{"params": [w], "use_muon": True, "momentum": 1.0}])
    group = SingleDeviceMuonWithAuxAdam([{"params": [w], "use_muon": True}]).param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["ns_method"]) == (0.02, 0.95, 0.0, "gram")


def test_plain_muon_defaults_and_step():
    w = torch.nn.Parameter(torch.ones(2, 5, dtype=F64))
    opt = SingleDeviceMuon([w], lr=0.1)
    w.grad = torch.randn(2, 5, generator=torch.Generator().manual_seed(6), dtype=F64)
    expected = 1 - 0.1 * reference_ns(0.05 * w.grad + 0.95 * 0.05 * w.grad)
    opt.step()
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-5)
