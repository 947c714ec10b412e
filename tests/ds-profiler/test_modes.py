"""get_model_profile modes (forward, generate, train), the backward count and recompute_fwd_factor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_profiler import FlopsProfiler, get_model_profile


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


FWD_MACS = 3 * (8 * 16 + 16 * 4)  # batch 3


def test_forward_mode_returns_numbers_or_strings():
    model = mlp()
    flops, macs, params = get_model_profile(model, input_shape=(3, 8), print_profile=False, as_string=False)
    assert macs == FWD_MACS and flops == 2 * FWD_MACS + 3 * 16 and params == 8 * 16 + 16 + 16 * 4 + 4
    strings = get_model_profile(model, input_shape=(3, 8), print_profile=False)
    assert strings == ("1.2 K", "576 MACs", "212")


def test_train_mode_counts_backward_and_restores_grads():
    model = mlp()
    model[0].weight.grad = marker = torch.full_like(model[0].weight, 7.0)
    flops, macs, _ = get_model_profile(model, input_shape=(3, 8), print_profile=False, as_string=False,
                                       mode="train")
    # Backward of a linear layer: grad input (skipped for the first layer, whose input needs no grad) and
    # grad weight, each one forward's MACs.
    bwd_macs = 2 * FWD_MACS - 3 * 8 * 16
    assert macs == FWD_MACS + bwd_macs
    assert flops > 2 * macs  # plus relu forward/backward and the bias-grad reductions
    assert model[0].weight.grad is marker and model[2].weight.grad is None


def test_train_mode_uses_hf_style_loss():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, labels):
            logits = self.fc(x)
            return {"logits": logits, "loss": ((logits - labels) ** 2).mean()}

    x, labels = torch.randn(2, 4), torch.randn(2, 4)
    _, macs, _ = get_model_profile(WithLoss(), args=[x], kwargs={"labels": labels}, mode="train",
                                   print_profile=False, as_string=False)
    assert macs == 2 * 16 + 2 * 16  # forward + grad weight only


def test_train_mode_without_differentiable_output_is_a_clear_error():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="mode='train'"):
        get_model_profile(model, input_shape=(2, 4), mode="train", print_profile=False)


def test_generate_mode_counts_every_forward(tiny):
    model = tiny.TinyGPT2(layers=1).eval()
    ids = torch.randint(0, 128, (1, 4))
    _, macs_one, _ = get_model_profile(model, kwargs={"input_ids": ids}, print_profile=False, as_string=False)
    _, macs_gen, _ = get_model_profile(model, args=[ids], kwargs={"max_new_tokens": 3}, mode="generate",
                                       print_profile=False, as_string=False)
    longer = [get_model_profile(model, kwargs={"input_ids": torch.randint(0, 128, (1, n))}, print_profile=False,
                                as_string=False)[1] for n in (4, 5, 6)]
    assert macs_gen == sum(longer) and macs_gen > macs_one


def test_generate_mode_needs_a_generate_method():
    with pytest.raises(ValueError, match="generate"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 2), mode="generate")


def test_recompute_factor_enters_the_training_step_estimate(capsys):
    model, x = mlp(), torch.randn(3, 8)
    prof = FlopsProfiler(model, recompute_fwd_factor=1.0)
    prof.start_profile()
    model(x)
    fwd = prof.get_total_flops()
    assert not prof.backward_observed()
    assert prof.get_total_step_flops() == 4 * fwd  # fwd + (2 + 1) x fwd
    prof.print_model_profile()
    assert "bwd flops per GPU (estimate, 3 * fwd flops per GPU)" in capsys.readouterr().out
    model(x).sum().backward()  # now a real backward runs under the profiler
    assert prof.backward_observed()
    measured = prof.get_total_backward_flops()
    assert measured > 0 and prof.get_total_step_flops() == prof.get_total_flops() + measured
    prof.end_profile()


def test_activation_checkpoint_recompute_is_counted_as_backward():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        def forward(self, x):
            return checkpoint(self.body, x, use_reentrant=False)

    plain, ckpt = mlp(), Checkpointed()
    ckpt.body.load_state_dict(plain.state_dict())
    x = torch.randn(3, 8)
    results = []
    for model in (plain, ckpt):
        prof = FlopsProfiler(model)
        prof.start_profile()
        model(x).sum().backward()
        results.append((prof.get_total_flops(), prof.get_total_backward_flops()))
        prof.end_profile()
    (fwd_plain, bwd_plain), (fwd_ckpt, bwd_ckpt) = results
    assert fwd_plain == fwd_ckpt
    # torch stops recomputing once the saved tensors backward needs exist again: the first linear and the
    # relu are rerun (their outputs feed the last layer's grads), the last linear is not.
    assert bwd_ckpt - bwd_plain == 2 * 3 * 8 * 16 + 3 * 16
    assert fwd_plain == 2 * 3 * 8 * 16 + 3 * 16 + 2 * 3 * 16 * 4


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "backward"}, "mode="), ({"input_shape": (0, 3)}, "input_shape"), ({"warm_up": -1}, "warm_up"),
    ({"args": "x"}, "args"), ({"ignore_modules": [int]}, "ignore_modules"), ({"input_shape": None}, "input_shape"),
])
def test_bad_arguments_are_named(kwargs, match):
    call = {"input_shape": (2, 8), "print_profile": False} | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        get_model_profile(mlp(), **call)


def test_recompute_factor_is_validated():
    with pytest.raises(ValueError, match="recompute_fwd_factor"):
        FlopsProfiler(mlp(), recompute_fwd_factor=-1)


@pytest.mark.parametrize("name", ["TinyGPT2", "TinyBert", "SmallCNN"])
def test_inference_mode_counts_like_no_grad(tiny, name):
    # Under inference_mode composite ops (linear, matmul, layer_norm) reach the profiler whole.
    model = getattr(tiny, name)().eval()
    call = {"args": [torch.randn(2, 3, 16, 16)]} if name == "SmallCNN" else {"kwargs": {
        "input_ids": torch.randint(0, 128, (2, 12))}}
    with torch.no_grad():
        expected = get_model_profile(model, print_profile=False, as_string=False, **call)
    with torch.inference_mode():
        got = get_model_profile(model, print_profile=False, as_string=False, **call)
    assert got == expected and expected[1] > 0


def test_backward_is_attributed_to_the_modules_whose_forward_it_differentiates():
    model, x = mlp(), torch.randn(3, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x).sum().backward()
    tree = prof.to_dict()["modules"]
    first, relu, last = tree["children"]
    assert first["backward_macs"] == 3 * 8 * 16  # grad weight only: the input needs no grad
    assert last["backward_macs"] == 2 * 3 * 16 * 4  # grad input and grad weight
    assert relu["backward_flops"] == 2 * 3 * 16 and relu["backward_macs"] == 0
    assert tree["backward_flops"] == prof.get_total_backward_flops()
    assert tree["backward_macs"] == first["backward_macs"] + last["backward_macs"]
    assert " bwd" in prof.model_profile_text()
    prof.end_profile()


def test_ignored_modules_backward_is_excluded_too():
    model, x = mlp(), torch.randn(3, 8)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.ReLU])
    model(x).sum().backward()
    tree = prof.to_dict()["modules"]
    assert tree["children"][1]["backward_flops"] == 0
    assert prof.get_total_backward_flops() == tree["backward_flops"]
    assert prof.get_total_backward_macs() == 3 * 8 * 16 + 2 * 3 * 16 * 4
    prof.end_profile()
