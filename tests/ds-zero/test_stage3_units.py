"""ZeRO-3 gather units and the prefetch trace, without processes: which modules gather together (leaf modules
by mark, class, name or granularity), and what the trace predicts."""

from __future__ import annotations

import pytest
import torch

from ds_zero.zero3._prefetch import TraceCache
from ds_zero.zero3.leaf import leaf_rule, set_z3_leaf_modules
from ds_zero.zero3.schedule import build_units


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Block(), Block())
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    return model


def _units(model, rule=None, threshold=0):
    return {u.name: len(u.params) for u in build_units(model, rule or leaf_rule(), threshold)}


def test_every_module_with_parameters_is_a_unit():
    assert _units(_model()) == {"Sequential": 1, "0": 2, "1.a": 2, "1.b": 2, "2.a": 2, "2.b": 2}


def test_leaf_modules_gather_their_subtree():
    model = _model()
    set_z3_leaf_modules(model, [Block])
    assert _units(model) == {"Sequential": 1, "0": 2, "1": 4, "2": 4}
    assert _units(_model(), leaf_rule(classes=["Block"])) == {"Sequential": 1, "0": 2, "1": 4, "2": 4}
    assert _units(_model(), leaf_rule(names=["2"])) == {"Sequential": 1, "0": 2, "1.a": 2, "1.b": 2, "2": 4}
    assert _units(_model(), leaf_rule(name_suffixes=["b"])) == _units(_model())  # 1.b, 2.b: already leaves


def test_leaf_modules_by_name_and_suffix():
    from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    model = _model()
    found, missing = set_z3_leaf_modules_by_name(model, ["1", "9"], raise_if_not_found=False)
    assert found == [model[1]] and missing == ["9"]
    set_z3_leaf_modules_by_suffix(model, "2.b")
    assert get_z3_leaf_modules(model) == [model[1], model[2].b]
    with pytest.raises(ValueError, match=r"names \['nope'\]"):
        set_z3_leaf_modules_by_name(model, "nope")


def test_granularity_threshold_merges_fine_modules():
    # a Block: 40 parameters over 2 descendants -> 13.3 per module; below 20 it is gathered whole
    assert _units(_model(), threshold=20) == {"Sequential": 1, "0": 2, "1": 4, "2": 4}
    assert _units(_model(), threshold=10) == _units(_model())


def test_trace_predicts_and_rebuilds():
    cache = TraceCache()
    for unit in (1, 2, 3, 2, 1):
        assert cache.record(unit, 10) is False  # no trace yet: nothing to follow
    cache.end_pass()
    assert [cache.record(u, 10) for u in (1, 2, 3)] == [True, True, True]
    trace = cache.trace
    assert trace.ahead(0, 15) == [1, 2]  # up to the position that reaches 15 elements
    assert trace.reuse_distance(1) == 10  # unit 2 comes back after unit 3's 10 elements
    assert trace.reuse_distance(2) is None
    assert cache.record(1, 10) is False  # the pass left the trace: it is rebuilt at the end
    assert cache.end_pass() is True and cache.trace.units == [1, 2, 3, 1]
