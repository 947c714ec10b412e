"""DeepSpeed 0.19 module paths clients import directly: ``deepspeed.runtime.fp16.loss_scaler``,
``deepspeed.runtime.progressive_layer_drop``, ``deepspeed.runtime.sparse_tensor`` (and the sparse gradient
all-reduce behind ``sparse_gradients``, on 2 gloo ranks), ``deepspeed.utils.timer``, ``deepspeed.utils.numa`` and
``deepspeed.utils.torch``; values are DeepSpeed's documented formulas and defaults."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from deepspeed.runtime.fp16 import loss_scaler
from deepspeed.runtime.fp16.loss_scaler import (
    CreateLossScaler,
    DynamicLossScaler,
    LossScaleConfig,
    LossScaleProfile,
    LossScaler,
    LossScalerBase,
)
from deepspeed.runtime.progressive_layer_drop import ProgressiveLayerDrop
from deepspeed.runtime.sparse_tensor import SparseTensor
from deepspeed.utils import numa
from deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer, ThroughputTimer, trim_mean
from deepspeed.utils.torch import (
    is_functorch_transforming,
    register_grad_hook,
    required_torch_version,
)


# ---- loss scalers ------------------------------------------------------------------------------------------------
def test_scalers_are_the_engines():
    from deepspeed.runtime.precision import loss_scalers as _loss_scaler

    assert issubclass(DynamicLossScaler, _loss_scaler.DynamicLossScaler)
    assert issubclass(LossScaler, _loss_scaler.StaticLossScaler)
    assert isinstance(_dynamic(), LossScalerBase) and isinstance(LossScaler(), LossScalerBase)


def _dynamic(**overrides) -> DynamicLossScaler:
    args = {"init_scale": 2**16, "scale_window": 3, "min_scale": 1, "delayed_shift": 1,
            "consecutive_hysteresis": False, **overrides}
    return DynamicLossScaler(**args)


def _schedule(scaler: DynamicLossScaler, overflows) -> list[float]:
    out = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        out.append(scaler.cur_scale)
    return out


# Recorded from DeepSpeed 0.19.8's DynamicLossScaler.update_scale: the scale doubles once scale_window clean steps
# have passed since the last overflow, at the step after (stable_interval = cur_iter - last_overflow_iter - 1).
@pytest.mark.parametrize(("overrides", "overflows", "expected"), [
    ({"scale_window": 2, "delayed_shift": 2}, [True, True, False, False, False, False],
     [2**16, 2**15, 2**15, 2**15, 2**16, 2**16]),
    ({}, [False] * 7, [2**16, 2**16, 2**16, 2**17, 2**17, 2**17, 2**18]),
    ({}, [True] + [False] * 7, [2**15, 2**15, 2**15, 2**15, 2**16, 2**16, 2**16, 2**17]),
    ({"delayed_shift": 2, "consecutive_hysteresis": True}, [True, False, True, True], [2**16, 2**16, 2**16, 2**15]),
])
def test_dynamic_loss_scaler_schedule_is_deepspeeds(overrides, overflows, expected):
    assert _schedule(_dynamic(**overrides), overflows) == expected


def test_dynamic_loss_scaler_construction():
    with pytest.raises(TypeError):
        DynamicLossScaler()  # DeepSpeed 0.19: every window argument is required
    s = _dynamic()
    assert (s.scale_factor, s.dynamic, s.dtype, s.cur_hysteresis) == (2.0, True, torch.half, 1)
    with pytest.raises(Exception, match="already at minimum"):
        _dynamic(init_scale=1).update_scale(True)


def test_a_scaler_unpickled_from_a_deepspeed_checkpoint_works():
    """DeepSpeed pickles its scalers into optimizer states; their attributes are ours, so such an object steps."""
    ds_state = {"cur_scale": 4, "dynamic": True, "cur_iter": 0, "last_overflow_iter": -1, "scale_factor": 2.0,
                "scale_window": 3, "min_scale": 1, "delayed_shift": 1, "cur_hysteresis": 1,
                "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dtype": torch.float16}
    assert set(ds_state) <= set(vars(_dynamic()))
    restored = DynamicLossScaler.__new__(DynamicLossScaler)
    restored.__dict__.update(ds_state)
    assert _schedule(restored, [False] * 4) == [4, 4, 4, 8]
    static = LossScaler.__new__(LossScaler)
    static.__dict__.update({"cur_scale": 1, "dynamic": False})
    assert static.loss_scale == 1 and set(vars(LossScaler())) == {"cur_scale", "dynamic"}


def test_scale_loss_backward_and_overflow_checks():
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    scaler = LossScaler(scale=8)
    scaler.backward((w * w).sum())
    torch.testing.assert_close(w.grad, 8 * 2 * w.detach())
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 16.0
    assert scaler.scale_gradient(None, (torch.ones(2),), None)[0].tolist() == [8.0, 8.0]
    assert scaler.has_overflow([w]) is False and scaler.dynamic is False
    dyn = _dynamic(init_scale=4)
    assert dyn.has_overflow_serial([w]) is False
    w.grad[0] = math.inf
    assert dyn.has_overflow_serial([w]) is True
    assert bool(DynamicLossScaler._has_inf_or_nan(torch.tensor([math.nan])))


def test_create_loss_scaler():
    args = {"init_scale": 2**8, "scale_window": 10, "delayed_shift": 3, "consecutive_hysteresis": True,
            "min_scale": 0.5}
    dyn = CreateLossScaler(torch.half, 0, True, args)
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.cur_scale, dyn.scale_window, dyn.delayed_shift, dyn.min_scale) == (256.0, 10, 3, 0.5)
    with pytest.raises(ValueError, match="needs dynamic_loss_args"):
        CreateLossScaler(torch.half, 0, True, None)
    static = CreateLossScaler(torch.half, 128, False, None)
    assert isinstance(static, LossScaler) and static.loss_scale == 128
    assert CreateLossScaler(torch.bfloat16, 128, True, args).loss_scale == 1.0  # only fp16 scales the loss
    with pytest.raises(ValueError, match="scale_window"):
        CreateLossScaler(torch.half, 0, True, {**args, "scale_window": 0})


def test_loss_scale_config():
    off = LossScaleConfig(torch.bfloat16, True, 1.0, None)
    assert (off.use_grad_scaling, off.dynamic_loss_scale, off.cur_scale) == (False, False, 1.0)
    static = LossScaleConfig(torch.float16, False, 64.0, None)
    assert (static.dynamic_loss_scale, static.cur_scale) == (False, 64.0)
    fused = LossScaleConfig(torch.float16, True, 0, None)  # fp16.loss_scale 0 selects dynamic scaling
    assert (fused.cur_scale, fused.scale_window, fused.min_loss_scale, fused.last_overflow_iter) == (
        2.0**32, 1000, 1, -1)
    unfused = LossScaleConfig(torch.float16, True, 1.0, None, profile=LossScaleProfile.UNFUSED)
    assert (unfused.cur_scale, unfused.min_loss_scale) == (2.0**16, 0.25)
    given = LossScaleConfig(torch.float16, True, 1.0, {"init_scale": 2**10, "scale_window": 5, "delayed_shift": 2,
                                                       "consecutive_hysteresis": False, "min_scale": 2})
    assert (given.cur_scale, given.scale_window, given.min_loss_scale) == (1024.0, 5, 2.0)
    assert loss_scaler.to_python_float(torch.tensor([3.5])) == 3.5


# ---- progressive layer drop --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("theta", "gamma", "step"), [(0.5, 0.001, 0), (0.5, 0.001, 100), (0.5, 0.001, 1000),
                                                      (0.2, 0.01, 250), (0.5, 0.001, 10**6)])
def test_pld_theta_schedule(theta, gamma, step):
    pld = ProgressiveLayerDrop(theta=theta, gamma=gamma)
    assert pld.get_theta() == 1.0  # every layer kept before the first update
    pld.update_state(step)
    expected = (1.0 - theta) * math.exp(-gamma * step) + theta
    assert pld.get_theta() == pytest.approx(expected, rel=1e-12)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pytest.approx(expected, rel=1e-12)}


def test_pld_defaults():
    pld = ProgressiveLayerDrop()
    assert (pld.theta, pld.gamma) == (0.5, 0.001)
    pld.update_state(1000)
    assert pld.get_theta() == pytest.approx(0.5 * math.exp(-1.0) + 0.5)


# ---- sparse tensors ----------------------------------------------------------------------------------------------
def _embedding_grad(indices: list[int], seed: int = 0) -> tuple[nn.Embedding, torch.Tensor]:
    torch.manual_seed(seed)
    emb = nn.Embedding(10, 4, sparse=True)
    out = emb(torch.tensor(indices))
    (out * torch.arange(1.0, out.numel() + 1).view_as(out)).sum().backward()
    return emb, emb.weight.grad


def test_sparse_tensor_round_trip_of_an_embedding_gradient():
    _, grad = _embedding_grad([1, 3, 1, 7])
    assert grad.is_sparse
    st = SparseTensor(grad)
    assert st.is_sparse and st.orig_dense_tensor is grad
    assert st.indices.tolist() == [1, 3, 7] and st.dense_size == [10, 4] and st.values.shape == (3, 4)
    torch.testing.assert_close(st.to_dense(), grad.to_dense())
    coo = st.to_coo_tensor()
    assert coo.is_sparse and coo.sparse_dim() == 1
    torch.testing.assert_close(coo.to_dense(), grad.to_dense())
    assert st.sparse_size() == (3 + 12, 40)
    assert SparseTensor.type() == "deepspeed.SparseTensor"
    assert "reduction_factor" in str(st)
    from_dense = SparseTensor(grad.to_dense())
    assert not from_dense.is_sparse and from_dense.indices.tolist() == [1, 3, 7]
    torch.testing.assert_close(from_dense.values, st.values)
    st.add(from_dense)
    torch.testing.assert_close(st.to_dense(), 2 * grad.to_dense())
    with pytest.raises(ValueError, match="dense sizes differ"):
        st.add(SparseTensor(torch.ones(3, 4)))


def test_sparse_tensor_keeps_rows_whose_entries_cancel():
    dense = torch.zeros(4, 2)
    dense[2] = torch.tensor([1.0, -1.0])
    assert SparseTensor(dense).indices.tolist() == [2]


# ---- timers ------------------------------------------------------------------------------------------------------
def test_synchronized_wall_clock_timer_measures(capsys):
    timers = SynchronizedWallClockTimer()
    fwd = timers("fwd")
    assert timers("fwd") is fwd and timers.get_timers() == {"fwd": fwd}
    for seconds in (0.02, 0.01):
        fwd.start()
        time.sleep(seconds)
        fwd.stop()
    elapsed = fwd.elapsed(reset=False)
    assert 30.0 <= elapsed < 30.0 + 500.0
    assert 15.0 <= fwd.mean() < 15.0 + 250.0  # ms; two records, none trimmed
    assert timers.get_mean(["fwd"])["fwd"] == pytest.approx(fwd.mean() * 1000.0, rel=0.01)
    with pytest.raises(RuntimeError, match="already been started"):
        fwd.start()
        fwd.start()
    assert fwd.elapsed() >= elapsed  # a running timer is closed, read, reset and restarted
    assert fwd.started_
    fwd.stop()
    timers.log(["fwd", "absent"], normalizer=2.0)
    line = capsys.readouterr().out
    assert line.startswith("[Rank -1] time (ms) | fwd: ") and "absent" not in line
    noop = NoopTimer()
    noop("x").start()
    noop("x").stop(record=True)
    assert noop("x").elapsed(reset=False) == 0 and noop.get_timers() == {}


def test_trim_mean():
    data = [1.0, 2.0, 3.0, 100.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert trim_mean(data, 0.1) == 2.0
    assert data[3] == 100.0  # not reordered
    assert trim_mean([], 0.1) == 0


def test_throughput_timer_reports_samples_per_second():
    lines = []
    tput = ThroughputTimer(SimpleNamespace(enabled=True, synchronized=True), batch_size=8, start_step=2,
                           steps_per_output=5, logging_fn=lines.append)
    assert tput.avg_samples_per_sec() == float("-inf")
    for _ in range(5):
        tput.start()
        time.sleep(0.01)
        tput.stop(global_step=True)
    assert (tput.global_step_count, tput.micro_step_count) == (5, 5)
    assert 0.03 <= tput.total_elapsed_time < 0.03 + 1.0  # the 2 warm-up steps are not timed
    assert 8 / (0.01 + 0.35) < tput.avg_samples_per_sec() <= 8 / 0.01
    assert len(lines) == 1 and "global_step=5" in lines[0] and "RunningAvgSamplesPerSec" in lines[0]
    off = ThroughputTimer(SimpleNamespace(enabled=False, synchronized=False), batch_size=8)
    off.start()
    off.stop(global_step=True)
    assert off.global_step_count == 0
    with pytest.raises(ValueError, match="steps_per_output"):
        ThroughputTimer(None, 8, steps_per_output=0)


# ---- numa --------------------------------------------------------------------------------------------------------
def test_parse_ranges():
    assert list(numa.parse_range("5")) == [5]
    assert list(numa.parse_range("2-4")) == [2, 3, 4]
    assert numa.parse_range_list("0,2-4,6") == [0, 2, 3, 4, 6]
    with pytest.raises(ValueError, match="two number separated by dash"):
        numa.parse_range("1-2-3")
    with pytest.raises(ValueError, match="larger than or equal"):
        numa.parse_range("4-2")
    with pytest.raises(ValueError, match="must not overlap"):
        numa.parse_range_list("0-3,2-5")


@given(st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True))
def test_core_list_strings_round_trip(cores):
    """Any ascending core set printed as numactl's -C string (runs collapsed) parses back to itself."""
    cores = sorted(cores)
    text = numa._core_string(cores)
    assert numa.parse_range_list(text) == cores
    assert len(text.split(",")) == 1 + sum(b != a + 1 for a, b in zip(cores[:-1], cores[1:], strict=True))


def test_numa_cores_are_the_launchers():
    from deepspeed.launcher.resources import numa_core_lists

    assert numa.get_numa_cores() == numa_core_lists()


@pytest.fixture
def fake_numa(monkeypatch):
    """A machine with the given NUMA layout (numactl installed)."""
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)

    def layout(cores):
        monkeypatch.setattr(numa, "get_numa_cores", lambda: cores)

    return layout


# expected commands recorded from DeepSpeed 0.19.8's get_numactl_cmd with the same get_numa_cores layouts
@pytest.mark.parametrize(("cores", "bind", "procs", "rank", "expected"), [
    ([[0, 1, 2, 3], [4, 5, 6, 7]], "0-7", 2, 1, (4, ["numactl", "-m", "1", "-C", "4-7"])),
    ([[0, 1, 2, 3], [4, 5, 6, 7]], "2-5", 1, 0, (4, ["numactl", "-C", "2-5"])),  # spans two nodes: no -m
    ([list(range(8))], "0,2,4-5,7", 1, 0, (5, ["numactl", "-m", "0", "-C", "0,2,4-5,7"])),
    ([[0, 1], [2, 3], [], []], "0-3", 2, 1, (2, ["numactl", "-p", "3", "-C", "2-3"])),  # flat-mode HBM
    ([[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]], "0-7", 2, 1,
     (4, ["numactl", "-m", "2,3", "-C", "4-7"])),  # fake NUMA: the node group
])
def test_get_numactl_cmd(fake_numa, cores, bind, procs, rank, expected):
    fake_numa(cores)
    assert numa.get_numactl_cmd(bind, procs, rank) == expected


def test_get_numactl_cmd_errors(fake_numa, monkeypatch):
    fake_numa([[0, 1]])
    with pytest.raises(ValueError, match="At least one core"):
        numa.get_numactl_cmd("0", 2, 0)
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(ValueError, match="KMP_AFFINITY"):
        numa.get_numactl_cmd("0-1", 1, 0)


# ---- deepspeed.utils.torch ---------------------------------------------------------------------------------------
def test_required_torch_version():
    assert required_torch_version(min_version=1.0)
    assert required_torch_version(min_version="2.0", max_version="99")
    assert not required_torch_version(max_version="1.0")
    assert not required_torch_version(min_version=99.0)
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()


def test_functorch_transform_detection():
    seen = []

    def f(x):
        seen.append(is_functorch_transforming())
        return (x * x).sum()

    f(torch.ones(2))
    torch.func.grad(f)(torch.ones(2))
    assert seen == [False, True]


def test_register_grad_hook_runs_after_accumulation():
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    seen = []
    handle = register_grad_hook(w, lambda p: seen.append(p.grad.clone()))
    (3 * w).sum().backward()
    (3 * w).sum().backward()
    assert [g.tolist() for g in seen] == [[3.0, 3.0], [6.0, 6.0]]
    handle.remove()


@pytest.mark.gpu
def test_timers_and_clipping_on_cuda():
    from deepspeed.runtime.utils import clip_grad_norm_

    timers = SynchronizedWallClockTimer()
    timer = timers("step")
    assert timer.use_host_timer is False  # device events, read when the time is asked for
    timer.start()
    torch.cuda._sleep(10**6)
    timer.stop()
    assert timer.elapsed() > 0.0
    g = torch.Generator(device="cuda").manual_seed(0)
    ours = [nn.Parameter(torch.randn(64, 32, device="cuda", generator=g)) for _ in range(3)]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape, device="cuda", generator=g)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm.device.type == "cuda"
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
