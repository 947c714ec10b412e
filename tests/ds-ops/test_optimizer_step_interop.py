"""State dicts move between DeepSpeed's CPU optimizers (int step counters inside) and torch's / ds_ops' fused and
foreach optimizers (tensor steps): a resume that switches ``offload_optimizer`` on or off continues the run."""

from __future__ import annotations

import copy

import pytest
import torch

from ds_ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam, FusedLion


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _pair(make_a, make_b, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer]:
    """Train with ``a``, save, continue with ``a`` (expected) and from the save with ``b`` (resumed)."""
    params = _params()
    a = make_a(params)
    _run(a, params, range(steps))
    saved, start = copy.deepcopy(a.state_dict()), [p.detach().clone() for p in params]
    _run(a, params, range(steps, steps + 2))
    expected = [p.detach().clone() for p in params]
    again = [torch.nn.Parameter(t.clone()) for t in start]
    b = make_b(again)
    b.load_state_dict(saved)
    _run(b, again, range(steps, steps + 2))
    return expected, [p.detach() for p in again], b


ADAM = [
    ("cpu_adam", lambda ps: DeepSpeedCPUAdam(ps, lr=0.01, adamw_mode=False)),
    ("torch_fused", lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)),
    ("torch_foreach", lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True)),
    ("fused_adam", lambda ps: FusedAdam(ps, lr=0.01, adam_w_mode=False)),
]


@pytest.mark.parametrize("save", ADAM, ids=[a[0] for a in ADAM])
@pytest.mark.parametrize("load", ADAM, ids=[a[0] for a in ADAM])
def test_adam_state_dicts_cross_load(save, load):
    expected, resumed, b = _pair(save[1], load[1])
    for e, r in zip(expected, resumed, strict=True):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)
    steps = [float(s["step"]) for s in b.state.values()]
    assert steps == [5.0, 5.0]


def test_cpu_state_dict_steps_are_float32_tensors_like_torch():
    params = _params()
    torch_sd = torch.optim.Adam(params, lr=0.01).state_dict  # the reference layout
    for opt in (DeepSpeedCPUAdam(params, lr=0.01), DeepSpeedCPUAdagrad(params, lr=0.01)):
        _run(opt, params, range(2))
        for state in opt.state_dict()["state"].values():
            assert torch.is_tensor(state["step"]) and state["step"].dtype == torch.float32 and state["step"] == 2
        assert all(isinstance(s["step"], int) for s in opt.state.values())  # the live counters stay ints
    assert callable(torch_sd)


def test_adagrad_and_lion_cross_load():
    expected, resumed, _ = _pair(lambda ps: torch.optim.Adagrad(ps, lr=0.1, foreach=True),
                                 lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1))
    for e, r in zip(expected, resumed, strict=True):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)
    expected, resumed, b = _pair(lambda ps: FusedLion(ps, lr=0.01), lambda ps: DeepSpeedCPULion(ps, lr=0.01))
    for e, r in zip(expected, resumed, strict=True):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)
    expected, resumed, b = _pair(lambda ps: DeepSpeedCPULion(ps, lr=0.01), lambda ps: FusedLion(ps, lr=0.01))
    for e, r in zip(expected, resumed, strict=True):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)
    assert all(isinstance(s["step"], int) for s in b.state.values())  # FusedLion counts in ints


@pytest.mark.parametrize("torch_kwargs", [{}, {"foreach": True}], ids=["default", "foreach"])
def test_cpu_adagrad_state_dict_loads_into_torch_adagrad(torch_kwargs):
    """DeepSpeed's Adagrad groups carry torch's keys (lr_decay, initial_accumulator_value, ...): torch's Adagrad
    reads them in its step, so the cross-load continues the run exactly, both ways."""
    group = DeepSpeedCPUAdagrad(_params(), lr=0.1).param_groups[0]
    torch_group = torch.optim.Adagrad(_params(), lr=0.1).param_groups[0]
    assert set(torch_group) <= set(group), set(torch_group) - set(group)
    assert group["lr_decay"] == 0 and group["initial_accumulator_value"] == 0 and group["maximize"] is False
    expected, resumed, b = _pair(lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1, weight_decay=0.01),
                                 lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01, **torch_kwargs))
    for e, r in zip(expected, resumed, strict=True):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)
    assert [float(s["step"]) for s in b.state.values()] == [5.0, 5.0]
    expected, resumed, _ = _pair(lambda ps: torch.optim.Adagrad(ps, lr=0.1, **torch_kwargs),
                                 lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1))
    for e, r in zip(expected, resumed, strict=True):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)


def test_cpu_adagrad_refuses_torch_options_it_does_not_compute():
    params = _params()
    saved = torch.optim.Adagrad(params, lr=0.1, lr_decay=0.5).state_dict()
    opt = DeepSpeedCPUAdagrad(params, lr=0.1)
    opt.load_state_dict(saved)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"lr_decay=0.5 is not supported; expected 0"):
        opt.step()
