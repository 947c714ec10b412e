"""Which module gets which cost: the innermost running module, and every caller up the stack."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_profiler import FlopsProfiler


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2.0  # relu + mul: 2 FLOPs/element of the inner module itself


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = self.a(x) + self.b(x)  # the add belongs to Outer itself
        return self.head(y)


def profiled(model: nn.Module, *inputs, ignore=None, **kwargs) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore)
    model(*inputs, **kwargs)
    prof.stop_profile()
    return prof


def test_costs_roll_up_to_every_ancestor():
    model, x = Outer(), torch.randn(3, 4)
    prof = profiled(model, x)
    tree = prof.to_dict()["modules"]
    by_name = {}

    def index(node):
        by_name[node["name"]] = node
        for child in node["children"]:
            index(child)

    index(tree)
    fc = 3 * 4 * 4
    assert by_name["a.fc"]["macs"] == fc and by_name["a.fc"]["flops"] == 2 * fc
    assert by_name["a"]["flops"] == 2 * fc + 2 * 12  # own relu and mul on 3x4
    assert by_name["head"]["macs"] == 3 * 4 * 2
    assert tree["macs"] == 2 * fc + 3 * 4 * 2
    assert tree["flops"] == 2 * by_name["a"]["flops"] + 12 + 2 * 3 * 4 * 2  # + Outer's own add
    assert tree["params"] == 2 * 20 + 10
    assert by_name["a"]["calls"] == 1 and tree["calls"] == 1
    prof.end_profile()


def test_ops_outside_the_model_are_not_counted():
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    prof = FlopsProfiler(model)
    prof.start_profile()
    y = model(x)
    (y * y).sum()  # after the forward: not part of the model
    assert prof.get_total_flops() == 2 * 2 * 4 * 4
    prof.end_profile()


def test_shared_module_accumulates_calls_and_parent_counts_each_call():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    prof = profiled(model, torch.randn(2, 4))
    tree = prof.to_dict()["modules"]
    assert tree["children"][0]["calls"] == 2
    assert tree["children"][0]["macs"] == 2 * (2 * 4 * 4)  # both calls booked to the one module
    assert tree["macs"] == 2 * (2 * 4 * 4)
    assert prof.get_total_params() == 20  # a shared module's parameters count once
    prof.end_profile()


def test_ignore_list_excludes_module_types_and_their_submodules():
    model, x = Outer(), torch.randn(3, 4)
    prof = profiled(model, x, ignore=[Inner])
    assert prof.get_total_macs() == 3 * 4 * 2  # only the head
    assert prof.get_total_flops() == 12 + 2 * 3 * 4 * 2  # Outer's add + head
    assert prof.get_total_params() == 50  # parameters are still stored, so still counted
    tree = prof.to_dict()["modules"]
    assert tree["children"][0]["ignored"] is True and tree["children"][0]["macs"] == 0
    assert "ignored" in prof.model_profile_text()
    prof.end_profile()


@pytest.mark.parametrize("bad", [nn.Linear, [nn.Linear, "Dropout"], [nn.Linear(2, 2)]])
def test_ignore_list_rejects_non_module_types(bad):
    prof = FlopsProfiler(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="ignore_list"):
        prof.start_profile(ignore_list=bad)
    assert not prof.started


class KwargsModel(nn.Module):
    """Hugging Face style: keyword inputs, optional ones, dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids=None, attention_mask=None, scale: float = 1.0):
        hidden = self.proj(self.embed(input_ids)) * scale
        if attention_mask is not None:
            hidden = hidden * attention_mask[..., None]
        return {"last_hidden_state": hidden}


def test_keyword_argument_models():
    model = KwargsModel()
    ids, mask = torch.randint(0, 16, (2, 5)), torch.ones(2, 5)
    prof = profiled(model, input_ids=ids, attention_mask=mask, scale=0.5)
    tokens = 2 * 5
    assert prof.get_total_macs() == tokens * 8 * 8
    assert prof.get_total_flops() == 2 * tokens * 64 + 2 * tokens * 8  # two elementwise muls
    prof.end_profile()


def test_reset_profile_zeroes_and_counting_continues():
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    model(x)
    model(x)
    assert prof.get_total_macs() == 2 * 2 * 16
    assert prof.get_total_duration() > 0
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()


def test_never_called_containers_show_their_childrens_sum(tiny):
    model = tiny.TinyGPT2()
    prof = profiled(model, input_ids=torch.randint(0, 128, (2, 6)))
    tree = prof.to_dict()["modules"]
    blocks = next(c for c in tree["children"] if c["name"] == "h")
    assert blocks["type"] == "ModuleList" and blocks["calls"] == 0
    assert blocks["macs"] == sum(b["macs"] for b in blocks["children"]) > 0
    assert blocks["duration_s"] == sum(b["duration_s"] for b in blocks["children"])
    prof.end_profile()


def test_profiling_started_inside_a_running_forward_counts_the_rest():
    class Starter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.prof = None

        def forward(self, x):
            self.prof = FlopsProfiler(self)
            self.prof.start_profile()  # this module's own frame does not exist yet
            return self.fc(x)

    model = Starter()
    model(torch.randn(2, 4))
    stats = model.prof.to_dict()["modules"]["children"][0]
    assert stats["calls"] == 1 and stats["macs"] == 2 * 16
    model.prof.end_profile()
