"""The engine's Muon and MuP optimizers from the config: parameter groups (use_muon flags, DeepSpeed's default
rule, muon_lr/adam_lr), the config's and the model's errors, and the optional ``mup`` package (imported only
when named; a clear error naming the optimizer and the package when it is missing)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _harness import run_distributed

from ds_config import ConfigError, load_config

BASE = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(5, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 5, bias=False)


def muon(**params) -> dict:
    return {**BASE, "optimizer": {"type": "Muon", "params": params}, "zero_optimization": {"stage": 2}}


def _groups_body() -> dict:
    import deepspeed

    out = {}
    engine, *_ = deepspeed.initialize(model=Tiny(), config=muon(lr=0.02, muon_lr=0.04, adam_lr=0.001, betas=[0.8, 0.9]))
    out["groups"] = [(g["name"], g["use_muon"], g["lr"], g.get("betas")) for g in engine.basic_optimizer.param_groups]
    out["flags"] = {n: p.use_muon for n, p in engine.module.named_parameters()}
    out["class"] = type(engine.optimizer.optimizer).__name__
    model = Tiny()
    model.lm_head.weight.use_muon = True  # the model's own flag is kept
    model.hidden.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=muon(lr=0.02))
    out["own_flag"] = [(g["use_muon"], g["lr"], len(g["params"])) for g in engine.basic_optimizer.param_groups]
    model = Tiny()
    model.hidden.bias.use_muon = True
    try:
        deepspeed.initialize(model=model, config=muon())
    except ValueError as exc:
        out["vector"] = str(exc)
    return out


def test_muon_groups_flags_and_errors():
    r = run_distributed(_groups_body, world_size=1, timeout=120)[0]
    assert r["groups"] == [("muon-params", True, 0.04, None), ("adam-params", False, 0.001, (0.8, 0.9))]
    assert r["flags"] == {"embed_tokens.weight": False, "hidden.weight": True, "hidden.bias": False,
                          "lm_head.weight": False}
    assert r["class"] == "MuonWithAuxAdam"
    assert r["own_flag"] == [(True, 0.02, 1), (False, 0.02, 1)]  # lm_head (own flag) with Muon; embed with Adam
    assert "shapes [(4,)]" in r["vector"] and "use_muon = False" in r["vector"]


@pytest.mark.parametrize("params,fragment", [
    ({"ns_method": "newton"}, "optimizer.params.ns_method='newton': accepted Newton-Schulz methods are 'gram', "
                              "'standard'"),
    ({"momentum": 1.0}, "optimizer.params.momentum=1.0: accepted is a number in [0, 1)"),
    ({"muon_lr": -0.1}, "optimizer.params.muon_lr=-0.1: accepted is a number >= 0"),
    ({"adam_lr": "fast"}, "optimizer.params.adam_lr='fast': accepted is a number >= 0"),
])
def test_muon_config_errors_name_key_value_and_accepted(params, fragment):
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "optimizer": {"type": "muon", "params": params}})
    assert fragment in str(info.value)


def test_muon_config_accepts_auto_and_case_variants():
    for name in ("Muon", "muon", "MUON"):
        cfg = load_config({**BASE, "optimizer": {"type": name, "params": {"ns_method": "auto", "muon_lr": 0.1}}})
        assert cfg.optimizer.name == "muon"


def _mup_body(installed: bool) -> list:
    import deepspeed

    if installed:  # a stand-in for the mup package: its optimizers are torch's with per-shape learning rates
        fake = types.ModuleType("mup")
        fake.MuAdam, fake.MuAdamW, fake.MuSGD = torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD
        sys.modules["mup"] = fake
    else:
        sys.modules["mup"] = None  # import mup -> ImportError
    out = []
    try:
        for name in ("MuAdam", "MuAdamW", "MuSGD"):
            config = {**BASE, "optimizer": {"type": name, "params": {"lr": 0.01}}}
            try:
                engine, *_ = deepspeed.initialize(model=torch.nn.Linear(3, 2), config=config)
                out.append(type(engine.basic_optimizer).__name__)
            except ConfigError as exc:
                out.append(str(exc))
    finally:
        del sys.modules["mup"]
    return out


def test_mup_optimizers_come_from_the_optional_package():
    assert run_distributed(_mup_body, world_size=1, args=(True,), timeout=120)[0] == ["Adam", "AdamW", "SGD"]
    errors = run_distributed(_mup_body, world_size=1, args=(False,), timeout=120)[0]
    for name, error in zip(("MuAdam", "MuAdamW", "MuSGD"), errors, strict=True):
        assert f"{name} comes from the 'mup' package, which is not installed" in error
        assert "pip install mup" in error and "optimizer.type" in error
