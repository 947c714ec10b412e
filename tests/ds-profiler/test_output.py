"""The printed profile: a stable snapshot (fake clock), depth limit, top modules, output_file, JSON."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from torch import nn

from ds_profiler import FlopsProfiler, get_model_profile
from ds_profiler import _counter as counter_module

SNAPSHOT = pathlib.Path(__file__).with_name("snapshots") / "small_model_profile.txt"


class FakeClock:
    """perf_counter advancing 1 ms per reading: every latency becomes a deterministic count of hook calls."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.block(torch.tanh(self.fc1(x))))


@pytest.fixture
def profiled(monkeypatch):
    monkeypatch.setattr(counter_module, "_clock", FakeClock().perf_counter)
    torch.manual_seed(0)
    model = Net()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():  # no autograd graph: no backward-attribution walk reading the clock
        model(torch.randn(3, 4))
    prof.stop_profile()
    yield prof
    prof.end_profile()


def test_snapshot_of_the_printed_tree(profiled, capsys):
    profiled.print_model_profile(profile_step=5, top_modules=2)
    out = capsys.readouterr().out
    assert out == SNAPSHOT.read_text()


def test_depth_limit_and_top_modules(profiled):
    shallow = profiled.model_profile_text(module_depth=1, top_modules=3)
    assert "(block): Sequential(" in shallow and "(0): Linear(" not in shallow
    assert "depth 1:" in shallow and "depth 2:" not in shallow
    params_line = next(line for line in shallow.splitlines() if line.strip().startswith("params") and "Linear" in line)
    assert len(re.findall(r"'\w+': ", params_line)) == 2  # depth 1 holds only Linear and Sequential
    full = profiled.model_profile_text()
    assert "(0): Linear(" in full and "depth 2:" in full
    top1 = [line for line in full.splitlines() if line.strip().startswith("MACs")]
    assert all(line.count("': '") == 1 for line in top1)


def test_detailed_false_omits_the_tree_and_output_file_receives_the_text(profiled, tmp_path, capsys):
    path = tmp_path / "profile.txt"
    profiled.print_model_profile(detailed=False, output_file=str(path))
    assert capsys.readouterr().out == ""
    text = path.read_text()
    assert "Aggregated Profile per GPU" in text and "Detailed Profile per GPU" not in text


def test_aggregated_profile_alone(profiled, capsys):
    profiled.print_model_aggregated_profile(module_depth=0, top_modules=1)
    assert capsys.readouterr().out.splitlines() == [
        "Top 1 modules in terms of params, MACs or fwd latency at different model depths:",
        "depth 0:",
        "    params      - {'Net': '146'}",
        "    MACs        - {'Net': '336 MACs'}",
        "    fwd latency - {'Net': '13 ms'}",  # 14 clock readings: Net and 6 submodules, two each
    ]


@pytest.mark.parametrize("kwargs", [{"module_depth": -2}, {"top_modules": 0}, {"module_depth": 1.5}])
def test_bad_print_arguments_are_named(profiled, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        profiled.print_model_profile(**kwargs)


def test_json_export_round_trips_the_tree(profiled, tmp_path):
    path = tmp_path / "profile.json"
    text = profiled.to_json(str(path))
    data = json.loads(path.read_text())
    assert data == json.loads(text)
    assert data["totals"]["macs"] == 3 * (4 * 8 + 8 * 8 + 8 * 2)
    modules = data["modules"]
    assert [c["name"] for c in modules["children"]] == ["fc1", "block", "fc2"]
    assert [c["name"] for c in modules["children"][1]["children"]] == ["block.0", "block.1", "block.2"]
    assert sum(c["macs"] for c in modules["children"]) == modules["macs"]
    assert data["forward_ops"]["aten.addmm"]["calls"] == 3


def test_get_model_profile_prints_to_output_file(tmp_path, capsys):
    path = tmp_path / "out.txt"
    get_model_profile(Net(), input_shape=(2, 4), output_file=str(path), module_depth=1, top_modules=2)
    assert capsys.readouterr().out == ""
    assert "Profile Summary at step 1:" in path.read_text()


class FakeTimer:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed(self, reset: bool = True) -> float:
        return self.ms


class FakeEngine:
    """What the summary reads from a DeepSpeed engine (duck-typed)."""

    world_size = 4
    dp_world_size = 2
    mp_world_size = 2

    def train_micro_batch_size_per_gpu(self) -> int:
        return 8

    def wall_clock_breakdown(self) -> bool:
        return True

    def timers(self, name: str) -> FakeTimer:
        return FakeTimer({"fwd": 10.0, "bwd": 20.0, "step": 5.0}[name])


def test_summary_with_an_engine_uses_its_sizes_and_timers():
    model = Net()
    prof = FlopsProfiler(model, ds_engine=FakeEngine(), recompute_fwd_factor=0.5)
    prof.start_profile()
    model(torch.randn(3, 4))
    text = prof.model_profile_text()
    prof.end_profile()
    lines = {line.split(":")[0].strip(): line.rsplit(":", 1)[1].strip() for line in text.splitlines()
             if ":  " in line}
    assert lines["world size"] == "4" and lines["model parallel size"] == "2" and lines["batch size per GPU"] == "8"
    assert lines["params of model = params per GPU * mp_size"] == "292"
    assert lines["fwd flops of model = fwd flops per GPU * mp_size"] == "1.68 K"
    assert lines["fwd latency"] == "10 ms" and lines["bwd latency"] == "20 ms" and lines["iter latency"] == "35 ms"
    # bwd estimate (2 + 0.5) x 840 = 2100 flops in 20 ms
    assert lines["bwd FLOPS per GPU = 2.5 * fwd flops per GPU / bwd latency"] == "105 KFLOPS"
    assert lines["samples/second"] == f"{8 * 4 / 0.035:.2f}"
