"""ZeRO-3's memory-efficient linear and granularity leaves, as DeepSpeed users see them:
- ``F.linear`` is ``zero3_linear_wrap`` while a ZeRO-3 engine with ``memory_efficient_linear`` lives, and the
  builtin again once the last one is destroyed;
- the autograd function runs under ``torch.func`` (grad, vmap), keeps the forward's autocast state for backward,
  and gives torch's gradients;
- ``stage3_module_granularity_threshold`` marks leaves by DeepSpeed's rule (elements per layer, containers never,
  the model itself included), visible through ``z3_leaf_module``;
- a checkpointed model gathered as one leaf releases everything after backward (2 gloo ranks against stage 0);
- a parameter returned from a forward is flagged ``is_external_param``; ``optimizer.leaf_parameters`` maps each leaf
  module to its trainable parameters, whose gradients are right after a direct ``loss.backward()``.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

from ds_zero.zero3.leaf import apply_granularity_threshold, z3_leaf_module
from ds_zero.zero3.linear import (
    LinearFunctionForZeroStage3,
    install_functional_linear,
    remove_functional_linear,
    zero3_linear_wrap,
)
from ds_zero.zero3.linear import (
    _owners as linear_owners,
)

BUILTIN_LINEAR = torch._C._nn.linear


class _Owner:
    """Stands for a ZeRO-3 scheduler holding the F.linear replacement."""


def test_functional_linear_replaced_while_a_user_lives():
    assert F.linear is BUILTIN_LINEAR
    owner_a, owner_b = _Owner(), _Owner()
    assert install_functional_linear(owner_a) and install_functional_linear(owner_b)
    try:
        assert F.linear is zero3_linear_wrap
        remove_functional_linear(owner_a)
        assert F.linear is zero3_linear_wrap  # one user left
    finally:
        remove_functional_linear(owner_b)
    assert F.linear is BUILTIN_LINEAR


def test_foreign_replacement_is_left_alone():
    def other(x, w, b=None):
        return BUILTIN_LINEAR(x, w, b)

    F.linear = other
    try:
        owner = _Owner()
        assert install_functional_linear(owner) is False
        remove_functional_linear(owner)
        assert F.linear is other
    finally:
        F.linear = BUILTIN_LINEAR


@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 3, 8)])
def test_gradients_equal_torch(shape):
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(shape, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(5, generator=gen)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    out = zero3_linear_wrap(*ours)
    (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
    expect = BUILTIN_LINEAR(*ref)
    (expect * torch.arange(expect.numel()).reshape(expect.shape)).sum().backward()
    assert torch.equal(out, expect)
    for a, e in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-6, atol=1e-6)
    assert "LinearFunctionForZeroStage3" in type(out.grad_fn).__name__


def test_torch_func_transforms():
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(4, 6, generator=gen), torch.randn(3, 6, generator=gen)
    grads, value = torch.func.grad_and_value(lambda w, x: zero3_linear_wrap(x, w).pow(2).sum(), argnums=(0, 1))(w, x)
    want = torch.func.grad(lambda w, x: BUILTIN_LINEAR(x, w, None).pow(2).sum(), argnums=(0, 1))(w, x)
    torch.testing.assert_close(grads, want)
    assert torch.allclose(value, BUILTIN_LINEAR(x, w, None).pow(2).sum())
    batched = torch.func.vmap(LinearFunctionForZeroStage3.apply, in_dims=(0, None))(torch.randn(5, 3, 6), w)
    assert batched.shape == (5, 3, 4)


def test_backward_runs_under_the_forwards_autocast_state():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    out = zero3_linear_wrap(x, w)
    assert out.grad_fn._fwd_used_autocast is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an outer autocast does not leak into this backward
        out.sum().backward()
    assert w.grad.dtype == torch.float32
    exact = torch.ones(2, 4).t().matmul(x.detach())
    assert torch.equal(w.grad, exact)  # computed in fp32, not bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = zero3_linear_wrap(x, w)
    assert low.dtype == torch.bfloat16 and low.grad_fn._fwd_used_autocast is True
    assert low.grad_fn._dtype == torch.bfloat16


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = torch.nn.ModuleList([_Pair(), _Pair()])
        self.big = torch.nn.Linear(16, 16)


def test_granularity_follows_deepspeeds_rule():
    model = _Model()
    # a _Pair: 40 elements over 3 layers (a, b, itself) -> 13; the ModuleList is a container, never a leaf;
    # the model: (80 + 272) elements over 8 layers (a, b, each pair, big, itself) -> 44
    apply_granularity_threshold(model, 13)
    assert [z3_leaf_module(m) for m in (model, model.stack, model.stack[0], model.stack[1])] == [0, 0, 1, 1]
    assert model.stack[0].ds_model_granularity == 13 and model.ds_model_granularity == 44
    whole = _Model()
    apply_granularity_threshold(whole, 44)
    assert z3_leaf_module(whole) and not z3_leaf_module(whole.stack[0])  # outermost first


def test_granularity_too_small_warns(caplog):
    model = _Model()
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        apply_granularity_threshold(model, 12)
    assert not any(z3_leaf_module(m) for m in model.modules())
    assert "finest module has 13 elements per layer" in caplog.text


class _Checkpointed(torch.nn.Module):
    """A frozen block called recursively inside a non-reentrant checkpoint, then a trainable head; the head
    returns its bias as well (an external parameter of the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 8)

    def block(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        x = torch.tanh(F.linear(x, self.frozen.weight, self.frozen.bias))
        return self.block(x, depth - 1) if depth else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, x, 2, use_reentrant=False)
        return self.head(h)


def _checkpoint_run(stage: int, threshold: int) -> dict:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    rank = dist.get_rank()
    torch.manual_seed(0)
    zero = {"stage": stage}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                     "stage3_max_reuse_distance": 0, "stage3_module_granularity_threshold": threshold})
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    model = _Checkpointed()
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    linear_patched = F.linear is zero3_linear_wrap and id(engine.zero3_scheduler) in linear_owners  # by this engine
    others = set(linear_owners) - {id(engine.zero3_scheduler)}  # engines of earlier tests in this worker process
    gen = torch.Generator().manual_seed(5)
    losses, leftovers = [], []
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)[2 * rank:2 * rank + 2].requires_grad_()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        if stage == 3:
            leftovers.append([n for n, p in engine.module.named_parameters()
                              if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE or p.ds_active_sub_modules])
        engine.step()
        losses.append(float(loss))
    out = {"losses": losses, "leftovers": leftovers, "patched": linear_patched,
           "leaf": z3_leaf_module(engine.module)}
    scheduler_id = id(engine.zero3_scheduler)
    engine.destroy()
    # destroy() gives up this engine's claim; torch's builtin is back unless an engine still alive holds one
    out["restored"] = scheduler_id not in linear_owners and (F.linear is BUILTIN_LINEAR) == (not others)
    return out


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_checkpointed_model_releases_everything_after_backward(threshold):
    got = run_distributed(_checkpoint_run, world_size=2, args=(3, threshold), timeout=90)
    base = run_distributed(_checkpoint_run, world_size=2, args=(0, 0), timeout=90)
    for rank in range(2):
        assert got[rank]["leftovers"] == [[]] * 3
        assert got[rank]["losses"] == pytest.approx(base[rank]["losses"], rel=1e-6)
        assert got[rank]["leaf"] is (threshold > 0)  # the whole model under the threshold: one leaf
        assert got[rank]["patched"] and got[rank]["restored"]
    assert base[0]["patched"] is False


class _ReturnsBias(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple:
        return F.linear(x, self.weight, self.bias), self.bias


class _UsesReturnedBias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.producer = _ReturnsBias(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.producer(x)
        return torch.tanh(h + bias)


def _external_flag() -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = _UsesReturnedBias()
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    before = model.producer.bias.is_external_param
    engine.backward(engine(torch.randn(1, 4)).sum())
    engine.step()
    out = {"before": before, "bias": model.producer.bias.is_external_param,
           "weight": model.producer.weight.is_external_param}
    engine.destroy()
    return out


def test_returned_parameter_is_flagged_external():
    assert run_distributed(_external_flag, world_size=2, timeout=60) == [
        {"before": False, "bias": True, "weight": False}] * 2


class _Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.final = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final(self.branches[0](x) + self.branches[1](x))


def _leaf_parameters_run() -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad, set_z3_leaf_modules

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Branches()
    reference = _Branches()
    reference.load_state_dict(model.state_dict())
    set_z3_leaf_modules(model, [torch.nn.ModuleList])
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    leaves = {type(m).__name__: len(ps) for m, ps in engine.optimizer.leaf_parameters.items()}
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    engine(x[2 * rank:2 * rank + 2]).pow(2).sum().backward()  # a direct backward through the leaf's hooks
    got = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
    for r in range(2):
        (reference(x[2 * r:2 * r + 2]).pow(2).sum() / 2).backward()
    engine.destroy()
    return {"leaves": leaves, "got": got, "want": [p.grad for p in reference.parameters()]}


def test_leaf_module_parameters_and_their_gradients():
    for out in run_distributed(_leaf_parameters_run, world_size=2, timeout=60):
        assert out["leaves"] == {"ModuleList": 4}  # one leaf module: both branches' weights and biases
        for have, want in zip(out["got"], out["want"], strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)


def test_functional_linear_is_released_by_a_dropped_owner():
    from ds_zero.zero3.linear import install_functional_linear, remove_functional_linear

    builtin = F.linear
    kept, dropped = _Owner(), _Owner()
    assert install_functional_linear(kept) and install_functional_linear(dropped)
    del dropped
    gc.collect()
    assert F.linear is zero3_linear_wrap  # one owner left
    # any weight goes through the wrapper while it is installed, empty layers included (a rank without heads)
    x = torch.randn(3, 0, requires_grad=True)
    w = torch.randn(4, 0, requires_grad=True)
    out = F.linear(x, w)
    out.sum().backward()
    assert out.shape == (3, 4) and x.grad.shape == (3, 0) and w.grad.shape == (4, 0)
    remove_functional_linear(kept)
    assert F.linear is builtin
    del kept
    gc.collect()
    assert F.linear is builtin


def test_memory_efficient_function_handles_empty_layers():
    x = torch.randn(2, 5, 0, requires_grad=True)
    w = torch.randn(3, 0, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = LinearFunctionForZeroStage3.apply(x, w, b)
    out.sum().backward()
    assert torch.equal(out.detach(), b.detach().expand(2, 5, 3))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert torch.equal(b.grad, torch.full((3,), 10.0))
