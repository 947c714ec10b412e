"""DeepSpeedCPUAdam: numerics vs torch.optim.Adam/AdamW and the reference, dtypes, fused copy, state_dict."""

from __future__ import annotations

import pytest
import torch
from _ds_ops_optim_helpers import SIZES, assert_rel_close, make_params, train_pair

from ds_ops import DeepSpeedCPUAdam, reference


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_100_steps(native, adamw, weight_decay):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    a, b, _, _ = train_pair(
        lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw),
        lambda p: torch_cls(p, lr=1e-2, weight_decay=weight_decay), make_params())
    assert_rel_close(a, b)


def test_param_groups_with_different_hyper_parameters(native):
    def groups(ps):
        return [{"params": ps[:2], "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.2},
                {"params": ps[2:], "lr": 1e-2, "eps": 1e-6}]

    a, b, ours, _ = train_pair(lambda g: DeepSpeedCPUAdam(g, weight_decay=0.01),
                               lambda g: torch.optim.AdamW(g, weight_decay=0.01), make_params(), groups=groups)
    assert_rel_close(a, b)
    assert ours.param_groups[0]["betas"] == (0.8, 0.99) and ours.param_groups[1]["weight_decay"] == 0.01


def test_no_bias_correction_matches_reference(native):
    class Reference(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self):
            ps = self.param_groups[0]["params"]
            for p in ps:
                self.state[p].setdefault("m", torch.zeros_like(p))
                self.state[p].setdefault("v", torch.zeros_like(p))
            reference.adam_update(ps, [p.grad for p in ps], [self.state[p]["m"] for p in ps],
                                   [self.state[p]["v"] for p in ps], [1] * len(ps), lr=1e-2, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=0.05, bias_correction=False, adamw_mode=True)

    a, b, _, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.05, bias_correction=False),
                            Reference, make_params())
    assert_rel_close(a, b)
    # and it differs from the bias-corrected update, so the flag is honoured
    c, _, _, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.05), Reference, make_params(),
                            steps=3)
    d, _, _, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.05, bias_correction=False),
                            Reference, make_params(), steps=3)
    assert not torch.allclose(c[3], d[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_states", [True, False])
def test_low_precision_params(native, dtype, fp32_states):
    def fallback(p):
        return DeepSpeedCPUAdam(p, lr=1e-3, weight_decay=0.1, fp32_optimizer_states=fp32_states)

    # the second optimizer runs the pure-torch reference (same fp32 math, one rounding per store)
    a, b, ours, _ = train_pair(fallback, lambda p: _force_fallback(fallback(p)), make_params(dtype=dtype), steps=20)
    assert a[3].dtype == dtype
    assert ours.state[a[3]]["exp_avg"].dtype == (torch.float32 if fp32_states else dtype)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    # equal but for rare one-ulp differences where fp32 rounding order tips a low-precision store
    diff = torch.cat([(x.float() - y.float()).abs().flatten() for x, y in zip(a, b, strict=True)])
    assert diff.max() <= ulp * max(y.float().abs().max() for y in b)
    assert (diff > 0).float().mean() < 0.01


def _force_fallback(opt):
    opt._kernel = None
    return opt


def test_fused_copy_writes_low_precision_params_in_the_same_step(native):
    params = make_params()
    a, b, _, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2), lambda p: DeepSpeedCPUAdam(p, lr=1e-2), params,
                            steps=1)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = DeepSpeedCPUAdam(ps, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    bufs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in ps[:3]] + [
        torch.empty(p.numel(), dtype=torch.float16) for p in ps[3:]]
    opt.step(fp16_param_groups=[bufs])
    for p, ref, buf in zip(ps, a, bufs, strict=True):
        assert torch.equal(p, ref)  # the copy does not change the update
        assert torch.equal(buf, p.detach().flatten().to(buf.dtype))  # RNE, bit-exact with torch's cast


def test_fused_copy_to_non_contiguous_target_uses_copy(native):
    p = torch.nn.Parameter(torch.randn(8, 4))
    p.grad = torch.randn(8, 4)
    target = torch.empty(4, 8, dtype=torch.bfloat16).t()
    DeepSpeedCPUAdam([p]).step(fp16_param_groups=[[target]])
    assert torch.equal(target, p.detach().to(torch.bfloat16))


def test_amsgrad_and_bad_hyper_parameters_are_rejected(native):
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        DeepSpeedCPUAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.5"):
        DeepSpeedCPUAdam(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="lr=-1"):
        DeepSpeedCPUAdam(p, lr=-1)
    opt = DeepSpeedCPUAdam(p)
    with pytest.raises(ValueError, match="weight_decay"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": -0.1})


def test_bad_params_and_grads_name_the_problem(native):
    p = torch.nn.Parameter(torch.zeros(4, 4).t())
    p.grad = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="param 0 of group 0"):
        DeepSpeedCPUAdam([p]).step()
    q = torch.nn.Parameter(torch.zeros(4))
    q.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="grad of param 0 of group 0 .*sparse=True"):
        DeepSpeedCPUAdam([q]).step()


def test_state_dict_round_trip_continues_identically(native):
    params = make_params(sizes=SIZES[:4])
    full, _, _, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1),
                               lambda p: torch.optim.SGD(p, lr=0.0), params, steps=10)
    half, _, opt, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1),
                                 lambda p: torch.optim.SGD(p, lr=0.0), params, steps=5)
    sd = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in half]
    opt2 = DeepSpeedCPUAdam(resumed, lr=5.0)  # hyper-parameters come from the state_dict
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.state[resumed[0]]["step"] == 5
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):  # replay the first 5 steps' grads to reach the same generator state
        for p in resumed:
            torch.randn(p.shape, generator=gen)
    for _ in range(5):
        for p in resumed:
            p.grad = torch.randn(p.shape, generator=gen)
        opt2.step()
    for x, y in zip(resumed, full, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_interoperates_with_torch_adamw(native, direction):
    params = make_params(sizes=SIZES[:4])
    ps_a = [torch.nn.Parameter(p.clone()) for p in params]
    ps_b = [torch.nn.Parameter(p.clone()) for p in params]
    first, second = (torch.optim.AdamW, DeepSpeedCPUAdam) if direction == "torch_to_ours" else (
        DeepSpeedCPUAdam, torch.optim.AdamW)
    opt_a = first(ps_a, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(6)]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(ref, step_grads, strict=True):
            p.grad = g.clone()
        opt_ref.step()
    for step_grads in grads[:3]:
        for p, g in zip(ps_a, step_grads, strict=True):
            p.grad = g.clone()
        opt_a.step()
    with torch.no_grad():
        for pa, pb in zip(ps_a, ps_b, strict=True):
            pb.copy_(pa)
    opt_b = second(ps_b, lr=1e-2, weight_decay=0.1)
    opt_b.load_state_dict(opt_a.state_dict())
    for step_grads in grads[3:]:
        for p, g in zip(ps_b, step_grads, strict=True):
            p.grad = g.clone()
        opt_b.step()
    assert_rel_close(ps_b, ref)


def test_bf16_params_keep_fp32_states_through_state_dict(native):
    p = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    p.grad = torch.randn(64).to(torch.bfloat16)
    opt = DeepSpeedCPUAdam([p])
    opt.step()
    sd = opt.state_dict()
    opt2 = DeepSpeedCPUAdam([p])
    opt2.load_state_dict(sd)
    assert opt2.state[p]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_multi_threaded_split_matches_torch(native):
    from _ds_ops_optim_helpers import BIG

    assert torch.get_num_threads() >= 1
    a, b, _, _ = train_pair(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1),
                            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), make_params(sizes=BIG),
                            steps=10)
    assert_rel_close(a, b)
