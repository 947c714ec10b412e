"""ZeRO-3's parameter tables (DeepSpeed's ``ZeROOrderedDict`` / ``ensure_zero_ordered_dict``): a plain
``_parameters`` dict is converted once, keeping the first container; submodules attached after
``deepspeed.initialize`` get a table at the next forward, and converted tables are never replaced."""

from __future__ import annotations

import torch
from _harness import run_distributed

from ds_zero.zero3.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict


def test_plain_dict_is_converted_once_keeping_the_first_container():
    m = torch.nn.Linear(4, 4, bias=False)
    first = m._parameters
    m._parameters = dict(first)
    ensure_zero_ordered_dict(m)
    table = m._parameters
    assert isinstance(table, ZeROOrderedDict) and list(table) == ["weight", "bias"] and table["weight"] is m.weight
    assert m._original_parameters is not table and table._parent_module is m
    m._original_parameters = first
    ensure_zero_ordered_dict(m)
    assert m._parameters is table and m._original_parameters is first  # idempotent


def test_missing_or_foreign_containers_are_left_alone():
    class Bare:
        pass

    bare = Bare()
    ensure_zero_ordered_dict(bare)
    bare._parameters = None
    ensure_zero_ordered_dict(bare)
    assert bare._parameters is None and not hasattr(bare, "_original_parameters")


def _late_attach_body() -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    table = engine.module[0]._parameters
    late = torch.nn.Linear(8, 8)
    late._parameters = dict(late._parameters)
    engine.module.add_module("late", late)
    x = torch.randn(2, 8)
    out = engine(x)
    expected = late(out)  # the attached module runs as a plain one and reads its own (whole) weights
    engine.backward(expected.sum())
    engine.step()
    engine(x)
    return {"late": type(late._parameters).__name__, "same": engine.module[0]._parameters is table,
            "shape": tuple(late.weight.shape)}


def test_module_attached_after_initialize_gets_a_table_at_the_next_forward():
    out = run_distributed(_late_attach_body, world_size=1, timeout=120)[0]
    assert out == {"late": "_ZeroParamDict", "same": True, "shape": (8, 8)}
