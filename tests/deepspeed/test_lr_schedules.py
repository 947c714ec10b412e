"""``deepspeed.runtime.lr_schedules``: every schedule against hand-computed values, resume exactness, the
builder from a typed ``scheduler`` config section, and the argument errors.

Expected values are worked out by hand from the documented formulas (the arithmetic is in the comments).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ds_config
from deepspeed.runtime import lr_schedules as L


def _optimizer(kind: str = "sgd", lrs: tuple[float, ...] = (0.1,)) -> torch.optim.Optimizer:
    """A real torch optimizer over one tiny parameter per group."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, betas=(0.9, 0.999))
    if kind == "adagrad":
        return torch.optim.Adagrad(groups)
    return torch.optim.SGD(groups, momentum=0.9 if kind == "sgd_momentum" else 0.0)


def _lrs_at(schedule, iterations: list[int]) -> dict[int, list[float]]:
    """Step one batch at a time, recording the optimizer's rates after the step that reaches each iteration."""
    out = {}
    if -1 in iterations:
        out[-1] = [g["lr"] for g in schedule.optimizer.param_groups]
    for it in range(max(iterations) + 1):
        schedule.step()
        assert schedule.last_batch_iteration == it
        if it in iterations:
            out[it] = [g["lr"] for g in schedule.optimizer.param_groups]
            assert schedule.get_last_lr() == out[it] == schedule.get_lr()
    return out


def _check(schedule, expected: dict[int, float | list[float]]) -> None:
    got = _lrs_at(schedule, sorted(expected))
    for it, want in expected.items():
        want = want if isinstance(want, list) else [want]
        assert got[it] == pytest.approx(want, rel=1e-12, abs=1e-15), f"iteration {it}"


# ---------------------------------------------------------------------------------------------- LRRangeTest


def test_lr_range_test_continuous():
    # lr = 0.01 * (1 + 2 * (i + 1) / 4)
    sched = L.LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                          lr_range_test_step_rate=2.0)
    _check(sched, {-1: 0.01, 0: 0.015, 2: 0.025, 6: 0.045})


def test_lr_range_test_staircase():
    # lr = 0.01 * (1 + 2 * floor((i + 1) / 4)): flat for 4 batches, then a jump
    sched = L.LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                          lr_range_test_step_rate=2.0, lr_range_test_staircase=True)
    _check(sched, {-1: 0.01, 0: 0.01, 2: 0.01, 3: 0.03, 6: 0.03, 7: 0.05})


def test_lr_range_test_defaults_and_groups():
    sched = L.LRRangeTest(_optimizer(lrs=(0.5, 0.5)), lr_range_test_min_lr=[0.001, 0.002])
    # defaults: step_size 2000, rate 1.0 -> after batch 1999 (i + 1 = 2000) the rate has doubled
    sched.step(1999)
    assert sched.get_last_lr() == pytest.approx([0.002, 0.004])


# ------------------------------------------------------------------------------------------------- WarmupLR


def test_warmup_lr_log():
    # lr = 0.1 * log(i + 1) / log(10) until i = 10, then 0.1
    sched = L.WarmupLR(_optimizer(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    _check(sched, {-1: 0.0, 0: 0.0, 1: 0.1 * math.log(2) / math.log(10), 9: 0.1, 10: 0.1, 25: 0.1})


def test_warmup_lr_linear():
    # lr = 0.02 + 0.08 * i / 8 until i = 8
    sched = L.WarmupLR(_optimizer(), warmup_min_lr=0.02, warmup_max_lr=0.1, warmup_num_steps=8,
                       warmup_type="linear")
    _check(sched, {-1: 0.02, 0: 0.02, 4: 0.06, 7: 0.09, 8: 0.1, 30: 0.1})


def test_warmup_lr_max_defaults_to_the_optimizer_lr():
    sched = L.WarmupLR(_optimizer(lrs=(0.5, 0.3)), warmup_num_steps=4, warmup_type="linear")
    assert sched.max_lrs == [0.5, 0.3]
    _check(sched, {-1: [0.0, 0.0], 2: [0.25, 0.15], 4: [0.5, 0.3]})


def test_warmup_lr_at_least_two_steps():
    # log(1) = 0 cannot normalise the curve: 1 warm-up step means 2, as in DeepSpeed (0 is an error there too)
    sched = L.WarmupLR(_optimizer(), warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    _check(sched, {0: 0.0, 1: 0.5, 2: 1.0})


def test_warmup_lr_per_group_lists():
    sched = L.WarmupLR(_optimizer(lrs=(1.0, 1.0)), warmup_min_lr=[0.0, 0.1], warmup_max_lr=[0.2, 0.5],
                       warmup_num_steps=4, warmup_type="linear")
    _check(sched, {0: [0.0, 0.1], 2: [0.1, 0.3], 9: [0.2, 0.5]})


# -------------------------------------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_lr_linear():
    # warm-up 0.1 * i / 10, then 0.1 * (20 - i) / (20 - 10), never below 0
    sched = L.WarmupDecayLR(_optimizer(), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10,
                            warmup_type="linear")
    _check(sched, {0: 0.0, 5: 0.05, 9: 0.09, 10: 0.1, 15: 0.05, 19: 0.01, 20: 0.0, 27: 0.0})


def test_warmup_decay_lr_log_and_default_max():
    sched = L.WarmupDecayLR(_optimizer(lrs=(7.0,)), total_num_steps=100, warmup_num_steps=10)
    # documented default warmup_max_lr = 0.001 (not the optimizer's 7.0)
    _check(sched, {3: 0.001 * math.log(4) / math.log(10), 55: 0.001 * 45 / 90})


def test_warmup_decay_lr_warns_when_total_is_shorter_than_warmup():
    with pytest.warns(UserWarning, match="total_num_steps=5 is less than warmup_num_steps=10"):
        L.WarmupDecayLR(_optimizer(), total_num_steps=5, warmup_num_steps=10)


# ------------------------------------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_lr_linear_with_ratios():
    # base lr 0.2; ratio = 0.1 + 0.9 * i / 4 during warm-up, then 0.05 + 0.95 * (1 + cos(pi * n / 8)) / 2
    # with n = i - 4 + 1, held at 0.05 once n reaches 8; before the first step DeepSpeed's ratio is 0
    sched = L.WarmupCosineLR(_optimizer(lrs=(0.2,)), total_num_steps=12, warmup_min_ratio=0.1,
                             warmup_num_steps=4, cos_min_ratio=0.05, warmup_type="linear")
    cos_1 = 0.05 + 0.95 * (1 + math.cos(math.pi / 8)) / 2
    _check(sched, {-1: 0.0, 0: 0.02, 2: 0.11, 4: 0.2 * cos_1, 7: 0.2 * 0.525, 11: 0.2 * 0.05, 40: 0.2 * 0.05})
    assert sched.get_lr_ratio() == pytest.approx(0.05)


def test_warmup_cosine_lr_log_and_groups():
    # log warm-up: ratio = 0 + log(i + 1) / log(4); every group scaled by the same ratio
    sched = L.WarmupCosineLR(_optimizer(lrs=(0.1, 0.3)), total_num_steps=100, warmup_num_steps=4)
    _check(sched, {1: [0.1 * 0.5, 0.3 * 0.5], 3: [0.1, 0.3]})
    assert sched.org_lrs == [0.1, 0.3]


# ------------------------------------------------------------------------------------------------- OneCycle


def test_one_cycle_phases_decay_and_adam_betas():
    opt = _optimizer("adam")
    sched = L.OneCycle(opt, 0.1, 1.0, cycle_first_step_size=4, cycle_second_step_size=2, decay_step_size=2,
                       decay_lr_rate=0.5, decay_mom_rate=0.1)
    # up: 0.1 + 0.9 * (i + 1) / 4; down: 1.0 - 0.9 * (i + 1 - 4) / 2; decay: 0.1 / (1 + 0.5 * n / 2), n = i - 5
    expected_lr = {-1: 0.1, 0: 0.325, 3: 1.0, 4: 0.55, 5: 0.1, 6: 0.1 / 1.25, 8: 0.1 / 1.75}
    # momentum mirrors it: 0.9 - 0.1 * scale; decay 0.9 * (1 + 0.1 * n / 2); before the first step the groups
    # hold cycle_min_mom, as DeepSpeed writes at construction
    expected_mom = {-1: 0.8, 0: 0.875, 3: 0.8, 4: 0.85, 5: 0.9, 6: 0.9 * 1.05, 8: 0.9 * 1.15}
    got_mom = {-1: opt.param_groups[0]["betas"]}
    for it in range(9):
        sched.step()
        got_mom[it] = opt.param_groups[0]["betas"]
        if it in expected_lr:
            assert sched.get_last_lr() == pytest.approx([expected_lr[it]]), it
    for it, mom in expected_mom.items():
        assert got_mom[it][0] == pytest.approx(mom), it
        assert got_mom[it][1] == 0.999  # the optimizer's second beta is kept
    # DeepSpeed's get_mom() gives Adam-style groups their (beta1, beta2) pair
    (beta1, beta2), = sched.get_mom()
    assert beta1 == pytest.approx(0.9 * 1.15) and beta2 == 0.999


def test_one_cycle_without_decay_holds_the_minimum():
    sched = L.OneCycle(_optimizer("sgd_momentum"), 0.1, 1.0, cycle_first_step_size=3, decay_lr_rate=0.5)
    _check(sched, {2: 1.0, 5: 0.1, 50: 0.1})  # decay_step_size 0: no decay
    assert sched.optimizer.param_groups[0]["momentum"] == pytest.approx(0.9)


def test_one_cycle_staircase():
    # DeepSpeed's stairs, 2 per half of 4 batches (t = i + 1): scale = floor(t * 2 / 4) / 2 going up and
    # floor((8 - t) * 2 / 4) / 2 coming down (counted from the cycle's end, so the falling half mirrors the
    # rising one)
    sched = L.OneCycle(_optimizer(), 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2,
                       cycle_momentum=False)
    _check(sched, {0: 0.0, 1: 0.5, 2: 0.5, 3: 1.0, 4: 0.5, 5: 0.5, 6: 0.0, 7: 0.0})


def test_one_cycle_sgd_momentum_and_groups():
    opt = _optimizer("sgd_momentum", lrs=(0.5, 0.5))
    sched = L.OneCycle(opt, [0.1, 0.2], [1.0, 2.0], cycle_first_step_size=2, cycle_min_mom=[0.8, 0.5],
                       cycle_max_mom=[0.9, 0.7])
    assert [g["momentum"] for g in opt.param_groups] == pytest.approx([0.8, 0.5])  # cycle_min_mom until a step
    sched.step()  # t = 1 of 2: half-way up
    assert sched.get_last_lr() == pytest.approx([0.55, 1.1])
    assert [g["momentum"] for g in opt.param_groups] == pytest.approx([0.85, 0.6])


def test_one_cycle_optimizer_without_momentum_disables_cycling():
    opt = _optimizer("adagrad")
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        sched = L.OneCycle(opt, 0.1, 1.0, cycle_first_step_size=2)
    sched.step()
    assert sched.get_mom() is None and "betas" not in opt.param_groups[0]


# ------------------------------------------------------------------------------------------ common behaviour


SCHEDULES = {
    "LRRangeTest": (L.LRRangeTest, {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
    "OneCycle": (L.OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                              "decay_step_size": 2, "decay_lr_rate": 0.3, "decay_mom_rate": 0.01}),
    "WarmupLR": (L.WarmupLR, {"warmup_num_steps": 4}),
    "WarmupDecayLR": (L.WarmupDecayLR, {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
    "WarmupCosineLR": (L.WarmupCosineLR, {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
}


def _train(schedule_name: str, steps: int, state: dict | None = None) -> tuple[list, torch.Tensor, dict]:
    """``steps`` training batches of a tiny regression, optionally resumed from ``state``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    cls, kwargs = SCHEDULES[schedule_name]
    sched = cls(opt, **kwargs)
    data = torch.randn(20, 4, 3, generator=torch.Generator().manual_seed(1))
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
    lrs = []
    for step in range(start, start + steps):
        loss = model(data[step]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        lrs.append((sched.get_last_lr(), opt.param_groups[0].get("betas")))
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "step": start + steps}
    return lrs, model.weight.detach().clone(), saved


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_resume_from_state_dict_equals_uninterrupted(name):
    straight, weight, _ = _train(name, 14)
    first, _, saved = _train(name, 7)
    assert saved["sched"]["last_batch_iteration"] == 6
    second, resumed_weight, _ = _train(name, 7, saved)
    assert first + second == straight
    assert torch.equal(resumed_weight, weight)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), iteration=st.integers(-1, 40))
def test_rates_are_a_function_of_the_position(name, iteration):
    """Stepping there, jumping there and loading a saved position give the same rates."""
    cls, kwargs = SCHEDULES[name]
    stepped, jumped, loaded = (cls(_optimizer("adam"), **kwargs) for _ in range(3))
    for _ in range(iteration + 1):
        stepped.step()
    jumped.step(iteration)
    loaded.load_state_dict({"last_batch_iteration": iteration})
    groups = [s.optimizer.param_groups[0] for s in (stepped, jumped, loaded)]
    assert groups[0]["lr"] == groups[1]["lr"] == groups[2]["lr"] == stepped.get_lr()[0]
    if iteration >= 0:  # before any step the constructor's groups hold cycle_min_mom, as DeepSpeed's
        assert groups[0]["betas"] == groups[1]["betas"] == groups[2]["betas"]


@settings(max_examples=60, deadline=None)
@given(low=st.floats(0, 1), span=st.floats(0, 1), steps=st.integers(1, 30), kind=st.sampled_from(["log", "linear"]),
       iteration=st.integers(0, 80))
def test_warmups_stay_between_their_bounds(low, span, steps, kind, iteration):
    high = low + span
    warm = L.WarmupLR(_optimizer(), warmup_min_lr=low, warmup_max_lr=high, warmup_num_steps=steps,
                      warmup_type=kind)
    decay = L.WarmupDecayLR(_optimizer(), total_num_steps=2 * steps + 2, warmup_min_lr=low, warmup_max_lr=high,
                            warmup_num_steps=steps, warmup_type=kind)
    warm.step(iteration)
    decay.step(iteration)
    assert low - 1e-12 <= warm.get_last_lr()[0] <= high + 1e-12
    assert 0.0 <= decay.get_last_lr()[0] <= high + 1e-12
    cycle = L.OneCycle(_optimizer("adam"), low, high, cycle_first_step_size=steps, cycle_first_stair_count=steps % 4)
    cycle.step(min(iteration, 2 * steps - 1))
    assert low - 1e-12 <= cycle.get_last_lr()[0] <= high + 1e-12
    assert 0.8 - 1e-12 <= cycle.get_mom()[0][0] <= 0.9 + 1e-12


def test_load_state_dict_restores_rates_and_base_lrs():
    opt = _optimizer(lrs=(0.2,))
    sched = L.WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2)
    sched.step(5)
    state = sched.state_dict()
    # a schedule built on an optimizer whose lr was already scheduled still scales the original lr
    other = L.WarmupCosineLR(_optimizer(lrs=(0.0123,)), total_num_steps=10, warmup_num_steps=2)
    other.load_state_dict(state)
    assert other.org_lrs == [0.2]
    assert other.get_last_lr() == sched.get_last_lr()
    assert other.optimizer.param_groups[0]["lr"] == sched.get_last_lr()[0]
    # DeepSpeed's checkpoints hold only the position
    plain = L.WarmupLR(_optimizer(), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    plain.load_state_dict({"last_batch_iteration": 4})
    assert plain.get_last_lr() == pytest.approx([0.04])
    with pytest.raises(ValueError, match="last_batch_iteration"):
        plain.load_state_dict({"step": 3})


def test_step_jumps_and_resume_through_the_constructor():
    a = L.WarmupDecayLR(_optimizer(), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10,
                        warmup_type="linear")
    a.step(last_batch_iteration=15)
    b = L.WarmupDecayLR(_optimizer(), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10,
                        warmup_type="linear", last_batch_iteration=15)
    assert a.get_last_lr() == b.get_last_lr() == pytest.approx([0.05])
    a.step()
    assert a.last_batch_iteration == 16 and a.get_last_lr() == pytest.approx([0.04])


def test_wrapped_optimizer_is_unwrapped():
    class Wrapper:  # the shape of DeepSpeed's fp16 / ZeRO optimizer wrappers
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = _optimizer()
    sched = L.WarmupLR(Wrapper(opt), warmup_max_lr=0.4, warmup_num_steps=2, warmup_type="linear")
    sched.step(1)
    assert sched.optimizer is opt and opt.param_groups[0]["lr"] == pytest.approx(0.2)
    with pytest.raises(TypeError, match="accepted: a torch.optim.Optimizer"):
        L.WarmupLR(object())


def test_module_constants_and_paths():
    import deepspeed.runtime.config
    import deepspeed.runtime.lr_schedules
    import deepspeed.runtime.zero.config

    assert L.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert all(hasattr(deepspeed.runtime.lr_schedules, name) for name in L.VALID_LR_SCHEDULES)
    assert (L.WARMUP_LOG_RATE, L.WARMUP_LINEAR_RATE, L.WARMUP_MAX_LR) == ("log", "linear", "warmup_max_lr")
    assert hasattr(deepspeed.runtime.config, "DeepSpeedConfig")  # its own module now (runtime/config.py)
    assert deepspeed.runtime.zero.config is ds_config.zero


# ------------------------------------------------------------------------------------------- config builder


def _section(scheduler: dict):
    return ds_config.load_config({"train_batch_size": 2, "scheduler": scheduler}).scheduler


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_builder_matches_direct_construction(name):
    cls, kwargs = SCHEDULES[name]
    built = L.build_lr_scheduler(_section({"type": name, "params": kwargs}), _optimizer("adam"))
    direct = cls(_optimizer("adam"), **kwargs)
    assert type(built) is cls
    for _ in range(9):
        built.step()
        direct.step()
        assert built.get_last_lr() == direct.get_last_lr()


def test_builder_defaults_and_torch_schedules():
    built = L.build_lr_scheduler(_section({"type": "WarmupLR"}), _optimizer(lrs=(0.3,)))
    assert (built.warmup_num_steps, built.warmup_type, built.max_lrs) == (1000, "log", [0.3])
    step_lr = L.build_lr_scheduler(_section({"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}),
                                   _optimizer(lrs=(0.4,)))
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)
    step_lr.optimizer.step()
    step_lr.step()
    step_lr.step()
    assert step_lr.get_last_lr() == pytest.approx([0.2])
    assert L.build_lr_scheduler(None, _optimizer()) is None


def test_builder_unknown_type_names_the_key_and_accepted_names():
    with pytest.raises(ds_config.ConfigError) as err:
        L.build_lr_scheduler(_section({"type": "TriangularThing"}), _optimizer())
    text = str(err.value)
    assert "scheduler.type" in text and "TriangularThing" in text
    assert all(name in text for name in L.VALID_LR_SCHEDULES) and "CosineAnnealingLR" in text


def test_builder_rejects_auto_and_bad_params():
    section = _section({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": "auto"}})
    with pytest.raises(ds_config.ConfigError) as err:
        L.build_lr_scheduler(section, _optimizer())
    assert set(err.value.paths) == {"scheduler.params.total_num_steps", "scheduler.params.warmup_max_lr"}
    assert '"auto"' in str(err.value)
    bad = _section({"type": "WarmupLR", "params": {"warmup_min_lr": 0.5, "warmup_max_lr": 0.1}})
    with pytest.raises(ds_config.ConfigError, match=r"scheduler\.params.*warmup_min_lr=0\.5 is above"):
        L.build_lr_scheduler(bad, _optimizer())
    torch_bad = _section({"type": "StepLR", "params": {"no_such_arg": 1}})
    with pytest.raises(ds_config.ConfigError, match=r"scheduler\.params.*StepLR"):
        L.build_lr_scheduler(torch_bad, _optimizer())


# ------------------------------------------------------------------------------------------- argument errors


ERRORS = [
    (L.LRRangeTest, {"lr_range_test_step_size": 0}, "lr_range_test_step_size=0", "integer >= 1"),
    (L.LRRangeTest, {"lr_range_test_step_size": 2.5}, "lr_range_test_step_size=2.5", "integer >= 1"),
    (L.LRRangeTest, {"lr_range_test_min_lr": 0.0}, "lr_range_test_min_lr=0.0", "> 0"),
    (L.LRRangeTest, {"lr_range_test_min_lr": -1.0}, "lr_range_test_min_lr=-1.0", ">= 0"),
    (L.LRRangeTest, {"lr_range_test_step_rate": -0.5}, "lr_range_test_step_rate=-0.5", ">= 0"),
    (L.LRRangeTest, {"lr_range_test_staircase": "yes"}, "lr_range_test_staircase='yes'", "True or False"),
    (L.LRRangeTest, {"last_batch_iteration": -2}, "last_batch_iteration=-2", "integer >= -1"),
    (L.OneCycle, {"cycle_min_lr": 0.5, "cycle_max_lr": 0.1}, "cycle_min_lr=0.5 is above cycle_max_lr=0.1",
     "cycle_min_lr <= cycle_max_lr"),
    (L.OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_min_mom": 0.95}, "cycle_min_mom=0.95",
     "cycle_min_mom <= cycle_max_mom"),
    (L.OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": -3},
     "cycle_first_step_size=-3", "integer >= 1"),
    (L.OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "decay_step_size": -1}, "decay_step_size=-1",
     "integer >= 0"),
    (L.OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_second_stair_count": -1},
     "cycle_second_stair_count=-1", "integer >= 0"),
    (L.OneCycle, {"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 0.5}, "cycle_min_lr=[0.1, 0.2]",
     "list of 1 such numbers"),
    (L.OneCycle, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "decay_lr_rate": -0.1}, "decay_lr_rate=-0.1", ">= 0"),
    (L.WarmupLR, {"warmup_type": "cosine"}, "warmup_type='cosine'", "'log' or 'linear'"),
    (L.WarmupLR, {"warmup_num_steps": -5}, "warmup_num_steps=-5", "integer >= 1"),
    (L.WarmupLR, {"warmup_num_steps": 0}, "warmup_num_steps=0", "integer >= 1"),  # DeepSpeed: ValueError
    (L.WarmupCosineLR, {"total_num_steps": 10, "warmup_num_steps": 0}, "warmup_num_steps=0", "integer >= 1"),
    (L.WarmupLR, {"warmup_min_lr": 0.2, "warmup_max_lr": 0.1}, "warmup_min_lr=0.2 is above warmup_max_lr=0.1",
     "warmup_min_lr <= warmup_max_lr"),
    (L.WarmupLR, {"warmup_max_lr": "auto"}, "warmup_max_lr='auto'", "a number >= 0"),
    (L.WarmupLR, {"warmup_min_lr": float("nan")}, "warmup_min_lr=nan", "a number >= 0"),
    (L.WarmupDecayLR, {"total_num_steps": 0}, "total_num_steps=0", "integer >= 1"),
    (L.WarmupDecayLR, {"total_num_steps": 10, "warmup_type": "exp"}, "warmup_type='exp'", "'log' or 'linear'"),
    (L.WarmupCosineLR, {"total_num_steps": -10}, "total_num_steps=-10", "integer >= 1"),
    (L.WarmupCosineLR, {"total_num_steps": 10, "cos_min_ratio": 1.5}, "cos_min_ratio=1.5", "[0, 1]"),
    (L.WarmupCosineLR, {"total_num_steps": 10, "warmup_min_ratio": -0.1}, "warmup_min_ratio=-0.1", "[0, 1]"),
    (L.WarmupCosineLR, {"total_num_steps": 10, "warmup_type": "Linear"}, "warmup_type='Linear'",
     "'log' or 'linear'"),
]


@pytest.mark.parametrize("cls, kwargs, bad, accepted", ERRORS, ids=[f"{c.__name__}-{b}" for c, _, b, _ in ERRORS])
def test_bad_arguments_name_argument_value_and_accepted(cls, kwargs, bad, accepted):
    with pytest.raises(ValueError) as err:
        cls(_optimizer(), **kwargs)
    assert bad in str(err.value) and accepted in str(err.value), str(err.value)


def test_bad_step_argument():
    sched = L.WarmupLR(_optimizer())
    with pytest.raises(ValueError, match="last_batch_iteration=-3"):
        sched.step(-3)


# ------------------------------------------------------------------------------------ DeepSpeed 0.19 parity


def _deepspeed_one_cycle_scale(batch: int, first: int, second: int, first_stairs: int, second_stairs: int) -> float:
    """DeepSpeed's ``OneCycle._get_scale_factor`` arithmetic, written out: the phase ``x`` of the cycle wraps
    at ``total``; stairs count from the cycle's start going up and from its end coming down."""
    total = first + second
    step_ratio = first / total
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    if x <= step_ratio:
        scale, stairs = x / step_ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (step_ratio - 1), second_stairs
    if stairs > 0:
        position = batch % total
        if position <= first:
            scale = math.floor(position * stairs / first) / stairs
        else:
            scale = math.floor((total - position) * stairs / second) / stairs
    return scale


@settings(max_examples=80, deadline=None)
@given(first=st.integers(1, 9), second=st.integers(0, 9), first_stairs=st.integers(0, 4),
       second_stairs=st.integers(0, 4), iteration=st.integers(-1, 25))
def test_one_cycle_matches_deepspeed_arithmetic(first, second, first_stairs, second_stairs, iteration):
    # cycle_second_step_size=0 included: DeepSpeed accepts it (a cycle without a falling half)
    sched = L.OneCycle(_optimizer("adam"), 0.1, 1.0, cycle_first_step_size=first, cycle_second_step_size=second,
                       cycle_first_stair_count=first_stairs, cycle_second_stair_count=second_stairs)
    sched.step(iteration)
    if iteration < first + second:
        scale = _deepspeed_one_cycle_scale(iteration + 1, first, second, first_stairs, second_stairs)
    else:
        scale = 0.0  # past the cycle, no decay configured: DeepSpeed holds cycle_min_lr / cycle_max_mom
    assert sched.get_last_lr() == pytest.approx([0.1 + 0.9 * scale], abs=1e-12)
    assert sched.get_mom() == [(pytest.approx(0.9 - 0.1 * scale, abs=1e-12), 0.999)]


def test_one_cycle_without_a_second_half():
    # DeepSpeed: cycle_second_step_size=0 rises over cycle_first_step_size batches; the cycle's last batch
    # wraps back to cycle_min_lr (it is never an error there)
    sched = L.OneCycle(_optimizer(), 0.1, 1.0, cycle_first_step_size=4, cycle_second_step_size=0,
                       cycle_momentum=False)
    _check(sched, {-1: 0.1, 0: 0.325, 1: 0.55, 2: 0.775, 3: 0.1, 9: 0.1})


def test_one_cycle_get_mom_pairs_per_group_lists():
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.ones(2))], "betas": (0.9, 0.999)},
                            {"params": [torch.nn.Parameter(torch.ones(2))], "betas": (0.85, 0.95)}], lr=0.1)
    sched = L.OneCycle(opt, 0.1, 1.0, cycle_first_step_size=2, cycle_min_mom=[0.8, 0.5], cycle_max_mom=[0.9, 0.7])
    # before the first step get_mom() reports the schedule's start (cycle_max_mom) while the groups hold
    # cycle_min_mom, both as DeepSpeed
    assert sched.get_mom() == [(0.9, 0.999), (0.7, 0.95)]
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.999), (0.5, 0.95)]
    sched.step()  # half-way up: beta1 half-way down, each group between its own bounds
    assert sched.get_mom() == [(pytest.approx(0.85), 0.999), (pytest.approx(0.6), 0.95)]
    assert [g["betas"] for g in opt.param_groups] == sched.get_mom()
    sched.step()  # top of the cycle: each group's cycle_min_mom
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.5])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_tensor_learning_rates_stay_tensors(name):
    # DeepSpeed's update_lr: a group whose lr is a tensor keeps that tensor, the rate written into it in place
    cls, kwargs = SCHEDULES[name]
    param = torch.nn.Parameter(torch.ones(2))
    given = torch.tensor(0.05, dtype=torch.float64)
    opt = torch.optim.Adam([param], lr=given)
    sched = cls(opt, **kwargs)
    for _ in range(5):
        param.grad = torch.ones(2)
        opt.step()
        sched.step()
        lr = opt.param_groups[0]["lr"]
        assert lr is given and lr.shape == () and lr.dtype == torch.float64
        assert lr.item() == pytest.approx(sched.get_lr()[0])
        assert sched.get_last_lr() == [lr]
    float_opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=0.05)
    float_sched = cls(float_opt, **kwargs)
    float_sched.step(4)
    assert type(float_opt.param_groups[0]["lr"]) is float
    assert float_opt.param_groups[0]["lr"] == pytest.approx(lr.item())


def test_unknown_warmup_type_stays_an_error():
    # DeepSpeed logs a warning and silently trains with the 'log' curve instead; the typed config rejects the
    # value too, so direct construction keeps the clear error naming the accepted values.
    for cls, extra in ((L.WarmupLR, {}), (L.WarmupDecayLR, {"total_num_steps": 10}),
                       (L.WarmupCosineLR, {"total_num_steps": 10})):
        with pytest.raises(ValueError, match="warmup_type='cosine'.*'log' or 'linear'"):
            cls(_optimizer(), warmup_type="cosine", **extra)


def test_tuning_arguments_give_a_scheduler_config():
    """``deepspeed.add_tuning_arguments``: DeepSpeed's flags and defaults; the parsed flags are a scheduler section
    the engine builds (``get_config_from_args``), and ``get_lr_from_config`` is the rate it starts from."""
    import argparse

    import deepspeed
    from deepspeed.runtime.lr_schedules import build_lr_scheduler, get_config_from_args, get_lr_from_config

    parser = deepspeed.add_tuning_arguments(argparse.ArgumentParser())
    assert get_config_from_args(parser.parse_args([])) == (None, "--lr_schedule not specified on command line")
    assert get_config_from_args(parser.parse_args(["--lr_schedule", "Nope"]))[0] is None
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_max_lr", "0.5", "--warmup_num_steps", "4"])
    config, error = get_config_from_args(args)
    assert error is None and config == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.5,
                                                                       "warmup_num_steps": 4, "warmup_type": "log"}}
    assert get_lr_from_config(config) == (0.5, "")
    from ds_config import load_config

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_lr_scheduler(load_config({"train_batch_size": 1, "scheduler": config}).scheduler, opt)
    for _ in range(4):
        schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
