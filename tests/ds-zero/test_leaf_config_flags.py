"""The config's ``leaf_module`` block marks modules as DeepSpeed's engine does: after ``apply_leaf_config``
``z3_leaf_module`` is true for the modules named by class, by ``named_modules()`` name and by name suffix."""

from __future__ import annotations

import torch

from ds_zero.zero3.leaf import apply_leaf_config, get_z3_leaf_modules, z3_leaf_module


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), Block(), torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_classes_names_and_suffixes_are_flagged_on_the_modules():
    model = _model()
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    found = apply_leaf_config(model, classes=[qualified, "transformers.NoSuchBlock"], names=["0"],
                              name_suffixes=["2"])
    assert [id(m) for m in found] == [id(model[1]), id(model[0]), id(model[2])]
    assert z3_leaf_module(model[1]) and z3_leaf_module(model[0]) and z3_leaf_module(model[2])
    assert not z3_leaf_module(model) and not z3_leaf_module(model[1].a)
    assert len(get_z3_leaf_modules(model)) == 3


def test_nothing_matching_flags_nothing():
    model = _model()
    assert apply_leaf_config(model, classes=["Missing"], names=["9"], name_suffixes=["zz"]) == []
    assert get_z3_leaf_modules(model) == []
