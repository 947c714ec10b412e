"""ZeRO stage 1/2 debug and modification APIs (``ds_zero.debug``, ``deepspeed.utils.safe_*``) through
``deepspeed.initialize`` on 1 and 2 gloo ranks, against a single-process torch AdamW reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN, HID, OUT = 6, 12, 3
LR, WD = 0.01, 0.01
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def make_config(stage: int, precision: str = "fp32", gas: int = 1, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "optimizer": ADAMW,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000, **extra}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def global_batch(world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2 * world, IN, generator=gen), torch.randn(2 * world, OUT, generator=gen)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error of the whole tensor."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def param_groups(model: torch.nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


class Pair:
    """The engine (rank's slice of each global batch) and a single-process reference (the whole batch)."""

    def __init__(self, config: dict, two_groups: bool = False) -> None:
        import deepspeed

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = make_model(0)
        if two_groups:  # a client optimizer: weights and biases in separate groups (two flat partitions)
            client = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WD)
            config = {k: v for k, v in config.items() if k != "optimizer"}
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
        else:
            self.engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        self.ref = make_model(0)
        self.ref_opt = torch.optim.AdamW(param_groups(self.ref) if two_groups else self.ref.parameters(), lr=LR,
                                         weight_decay=WD)
        self.params = [p for _, p in self.engine.module.named_parameters()]
        self.ref_params = list(self.ref.parameters())
        self.dtype = self.params[0].dtype

    def backward(self, seed: int, ref_scale: float = 1.0) -> None:
        x, y = global_batch(self.world, seed)
        lo = 2 * self.rank
        loss = torch.nn.functional.mse_loss(self.engine(x[lo:lo + 2].to(self.dtype)).float(), y[lo:lo + 2])
        self.engine.backward(loss)
        if ref_scale:
            (torch.nn.functional.mse_loss(self.ref(x), y) * ref_scale).backward()

    def step(self) -> None:
        self.engine.step()
        self.ref_opt.step()
        self.ref_opt.zero_grad()

    def assert_matches_reference(self, rtol: float) -> None:
        for p, r in zip(self.params, self.ref_params, strict=True):
            assert rel(p, r) <= rtol, f"shape {tuple(p.shape)}: relative error {rel(p, r):.3g} > {rtol}"


# ---- getters --------------------------------------------------------------------------------------------------
def _getters_body(stage: int, precision: str, extra: dict) -> dict:
    from ds_zero.debug import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    two_groups = extra.pop("two_groups", False)
    pair = Pair(make_config(stage, precision, **extra), two_groups)
    assert len(pair.engine.optimizer.groups) == (2 if two_groups else 1)
    if "offload_optimizer" in extra.get("zero_optimization", {}):  # masters and states in CPU memory
        assert type(pair.engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    tol = 1e-5 if precision == "fp32" else 3e-2
    for p in pair.params:  # the fp32 master of a (bf16) weight is an exact copy
        full = safe_get_full_fp32_param(p)
        assert full.dtype == torch.float32 and full.shape == p.shape and torch.equal(full, p.detach().float())
    with pytest.raises(ValueError, match="has not stepped"):
        safe_get_full_optimizer_state(pair.params[0], "exp_avg")
    assert safe_get_full_grad(pair.params[0]) is None  # no backward yet
    pair.backward(seed=1)
    scale = pair.engine.optimizer.loss_scale  # fp16: the stored gradients carry it (as in DeepSpeed)
    assert scale == (2.0 ** 8 if precision == "fp16" else 1.0)
    grads = [safe_get_full_grad(p) for p in pair.params]
    for g, p, r in zip(grads, pair.params, pair.ref_params, strict=True):
        assert g.shape == p.shape and g.device == p.device
        assert rel(g / scale, r.grad) <= tol, f"grad of {tuple(p.shape)}: relative error {rel(g / scale, r.grad):.3g}"
    pair.step()
    for g, p, r in zip(grads, pair.params, pair.ref_params, strict=True):
        g = g.float() / scale
        exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
        assert exp_avg.dtype == torch.float32 and exp_avg.shape == p.shape
        # after one AdamW step exp_avg = (1 - beta1) * grad: the partitions were assembled consistently
        torch.testing.assert_close(exp_avg, 0.1 * g.float(), rtol=1e-6, atol=1e-9)
        assert rel(exp_avg, pair.ref_opt.state[r]["exp_avg"]) <= tol
        assert rel(safe_get_full_optimizer_state(p, "exp_avg_sq"), pair.ref_opt.state[r]["exp_avg_sq"]) <= 2 * tol
        master = safe_get_full_fp32_param(p)
        assert rel(master, r) <= tol
        assert torch.equal(master.to(p.dtype), p.detach())  # the model weight is the rounded master
        assert safe_get_full_grad(p) is None  # the step cleared the gradients
    with pytest.raises(ValueError, match="'exp_avg', 'exp_avg_sq'"):
        safe_get_full_optimizer_state(pair.params[0], "momentum_buffer")
    return {"grad_dtype": str(grads[0].dtype), "weight": pair.params[0].detach().float().clone()}


@pytest.mark.parametrize(("stage", "world", "precision", "extra", "grad_dtype"), [
    (1, 1, "fp32", {}, "torch.float32"),
    (1, 2, "fp32", {}, "torch.float32"),
    (2, 1, "fp32", {}, "torch.float32"),
    (2, 2, "fp32", {}, "torch.float32"),
    (2, 2, "bf16", {}, "torch.bfloat16"),
    (1, 2, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}, "torch.float32"),
    (2, 2, "fp16", {}, "torch.float16"),
    (2, 2, "fp32", {"zero_optimization": {"stage": 2, "round_robin_gradients": True}, "two_groups": True},
     "torch.float32"),
    (2, 2, "fp32", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},  # DeepSpeedCPUAdam
                    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}, "torch.float32"),
])
def test_full_getters_match_reference(stage, world, precision, extra, grad_dtype):
    results = run_distributed(_getters_body, world_size=world, args=(stage, precision, extra), timeout=60)
    assert all(r["grad_dtype"] == grad_dtype for r in results)
    assert all(torch.equal(r["weight"], results[0]["weight"]) for r in results)


# ---- setters ----------------------------------------------------------------------------------------------------
def _setters_body(stage: int, two_groups: bool) -> dict:
    from ds_zero.debug import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_update_full_grad_vectorized,
    )

    pair = Pair(make_config(stage), two_groups)
    w0, w2 = pair.params[0], pair.params[2]
    value = torch.linspace(-1.0, 1.0, w0.numel()).view(w0.shape)
    safe_set_full_fp32_param(w0, value)  # before any step, as the spec allows
    assert torch.equal(w0.detach(), value) and torch.equal(safe_get_full_fp32_param(w0), value)
    with torch.no_grad():
        pair.ref_params[0].copy_(value)
    pair.backward(seed=1)
    pair.step()
    pair.assert_matches_reference(1e-5)

    # optimizer state: zero exp_avg, replace exp_avg_sq
    sq = torch.full(w0.shape, 0.25)
    safe_set_full_optimizer_state(w0, torch.zeros(w0.shape), "exp_avg")
    safe_set_full_optimizer_state(w0, sq, "exp_avg_sq")
    assert torch.equal(safe_get_full_optimizer_state(w0, "exp_avg"), torch.zeros(w0.shape))
    assert torch.equal(safe_get_full_optimizer_state(w0, "exp_avg_sq"), sq)
    pair.ref_opt.state[pair.ref_params[0]]["exp_avg"].zero_()
    pair.ref_opt.state[pair.ref_params[0]]["exp_avg_sq"].copy_(sq)
    pair.backward(seed=2)
    pair.step()
    pair.assert_matches_reference(1e-5)

    # gradient: replace one parameter's averaged gradient
    pair.backward(seed=3)
    new_grad = torch.linspace(0.5, -0.5, w2.numel()).view(w2.shape)
    safe_set_full_grad(w2, new_grad)
    assert torch.equal(safe_get_full_grad(w2), new_grad)
    pair.ref_params[2].grad.copy_(new_grad)
    pair.step()
    pair.assert_matches_reference(1e-5)

    # vectorized update, one-argument and (grad, param) forms
    for seed, func, update in ((4, lambda g: g * 3.0 - 0.125, lambda g, p: g * 3.0 - 0.125),
                               (5, lambda g, p: g * p.dim(), lambda g, p: g * p.dim())):
        pair.backward(seed=seed)
        before = [safe_get_full_grad(p) for p in pair.params]
        safe_update_full_grad_vectorized(pair.params, func)
        for p, b, r in zip(pair.params, before, pair.ref_params, strict=True):
            assert torch.equal(safe_get_full_grad(p), update(b, p))
            r.grad.copy_(update(r.grad, r))
        pair.step()
        pair.assert_matches_reference(1e-5)
    return {name: t.detach().clone() for name, t in pair.engine.module.state_dict().items()}


@pytest.mark.parametrize(("stage", "world", "two_groups"), [(1, 2, False), (2, 2, True), (2, 1, False)])
def test_setters_change_training_like_the_reference(stage, world, two_groups):
    results = run_distributed(_setters_body, world_size=world, args=(stage, two_groups), timeout=60)
    for r in results[1:]:  # every rank holds the same (full) weights
        assert all(torch.equal(r[k], results[0][k]) for k in r)


def _bf16_setters_body() -> None:
    from ds_zero.debug import safe_get_full_fp32_param, safe_set_full_fp32_param

    pair = Pair(make_config(2, "bf16"))
    w0 = pair.params[0]
    value = torch.linspace(-1.0, 1.0, w0.numel()).view(w0.shape) / 3  # not representable in bf16
    safe_set_full_fp32_param(w0, value)
    assert torch.equal(safe_get_full_fp32_param(w0), value)  # the fp32 master keeps every bit
    assert w0.dtype == torch.bfloat16 and torch.equal(w0.detach(), value.bfloat16())
    pair.backward(seed=1, ref_scale=0.0)
    pair.engine.step()
    master = safe_get_full_fp32_param(w0)
    assert torch.equal(master.bfloat16(), w0.detach()) and 0 < rel(master, value) < 0.1  # it trained from there


def test_bf16_set_fp32_param_updates_master_and_weight():
    run_distributed(_bf16_setters_body, world_size=2, timeout=60)


# ---- gradient phases under accumulation ------------------------------------------------------------------------
def _accumulation_body(stage: int) -> dict:
    from ds_zero.debug import safe_get_full_grad, safe_set_full_grad

    pair = Pair(make_config(stage, gas=2))
    pair.backward(seed=1, ref_scale=0.0)  # first micro batch: its gradient is then erased
    reducer = pair.engine.optimizer.reducer
    phase = "partition" if reducer.reduced else "local"
    if phase == "local":  # stage 1 before the boundary: the rank's own gradient
        assert all(torch.equal(safe_get_full_grad(p), p.grad) for p in pair.params)
    for p in pair.params:
        safe_set_full_grad(p, torch.zeros(p.shape))
        assert torch.equal(safe_get_full_grad(p), torch.zeros(p.shape))
    pair.engine.step()  # not a boundary: only counts the micro step
    pair.backward(seed=2, ref_scale=0.5)  # the engine divides each micro loss by gas = 2
    for p, r in zip(pair.params, pair.ref_params, strict=True):
        assert rel(safe_get_full_grad(p), r.grad) <= 1e-5
    pair.step()
    pair.assert_matches_reference(1e-5)
    return {"phase": phase}


@pytest.mark.parametrize(("stage", "world", "phase"), [(1, 2, "local"), (2, 2, "partition"), (1, 1, "local")])
def test_set_grad_between_micro_steps(stage, world, phase):
    results = run_distributed(_accumulation_body, world_size=world, args=(stage,), timeout=60)
    assert [r["phase"] for r in results] == [phase] * world


# ---- parameters ZeRO does not partition, ZeRO-3 local APIs, bad input -----------------------------------------
def _edges_body() -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param as public_getter
    from ds_zero import debug
    from ds_zero.utils import is_zero_param

    assert public_getter is debug.safe_get_full_fp32_param
    model = make_model(0)
    model[2].bias.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, config=make_config(2))
    frozen, w0 = model[2].bias, engine.module[0].weight
    assert debug.safe_get_full_fp32_param(frozen) is None
    assert debug.safe_get_full_optimizer_state(frozen, "exp_avg") is None
    assert debug.safe_get_full_grad(frozen) is None
    with pytest.raises(ValueError, match="not partitioned by a ZeRO stage 1/2 optimizer"):
        debug.safe_set_full_fp32_param(frozen, torch.zeros(OUT))
    with pytest.raises(ValueError, match="not partitioned"):
        debug.safe_set_full_grad(frozen, torch.zeros(OUT))
    with pytest.raises(ValueError, match=r"shape \(3,\) \(3 elements\); the parameter has shape \(12, 6\)"):
        debug.safe_set_full_fp32_param(w0, torch.zeros(3))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        debug.safe_set_full_fp32_param(w0, [0.0] * w0.numel())
    with pytest.raises(TypeError, match="update_func must be callable"):
        debug.safe_update_full_grad_vectorized([w0], 3.0)
    local_calls = [(debug.safe_get_local_fp32_param, ()), (debug.safe_get_local_grad, ()),
                   (debug.safe_get_local_optimizer_state, ("exp_avg",)),
                   (debug.safe_set_local_fp32_param, (torch.zeros(1),)),
                   (debug.safe_set_local_grad, (torch.zeros(1),)),
                   (debug.safe_set_local_optimizer_state, (torch.zeros(1), "exp_avg"))]
    for func, args in local_calls:
        with pytest.raises(AssertionError, match="only defined for ZeRO-3 partitioned parameters.*stage 2"):
            func(w0, *args)
    with pytest.raises(ValueError, match="not partitioned by ZeRO. Use safe_get_full_grad"):
        debug.safe_get_local_grad(frozen)
    assert not is_zero_param(w0) and not is_zero_param(frozen)
    w0.ds_id = 7  # what ZeRO-3 marks its parameters with
    assert is_zero_param(w0)
    with pytest.raises(AssertionError, match="has a ds_id, but no ZeRO stage 3 optimizer"):
        debug.safe_get_local_fp32_param(w0)


def test_unpartitioned_params_local_apis_and_bad_input():
    run_distributed(_edges_body, world_size=1, timeout=60)


def test_unmanaged_param_grad_is_its_own():
    from ds_zero.debug import safe_get_full_grad, safe_set_full_grad, safe_update_full_grad_vectorized

    p = torch.nn.Parameter(torch.ones(3))
    assert safe_get_full_grad(p) is None
    p.grad = torch.full((3,), 2.0)
    assert safe_get_full_grad(p) is p.grad
    safe_set_full_grad(p, torch.arange(3.0))
    safe_update_full_grad_vectorized([p], lambda g: g + 1)
    assert torch.equal(p.grad, torch.arange(3.0) + 1)
