"""The ``eigenvalue`` section: per-block Hessian eigenvalues by power iteration (``deepspeed.runtime.eigenvalue``),
estimated by the engine at accumulation boundaries and written to the monitors under DeepSpeed's event names."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

from deepspeed.runtime.eigenvalue import Eigenvalue
from deepspeed.runtime.engine import _eigenvalue_summary_events


class _TwoBlocks(torch.nn.Module):
    """loss = |W0 x|^2 / 2 + |W1 (2x)|^2 / 2: block 1's Hessian is 4 times block 0's (X^T X per output row)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(3, 2, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.layers[0](x).square().sum() + self.layers[1](2 * x).square().sum())


def test_summary_events_follow_the_block_values():
    events = _eigenvalue_summary_events({"a": (1.25, 0), "b": (0.5, 1)}, global_samples=128)
    assert events == [("Train/Eigenvalues/ModelBlockParam_0", 1.25, 128),
                      ("Train/Eigenvalues/ModelBlockParam_1", 0.5, 128)]


def test_power_iteration_finds_the_hessian_eigenvalues():
    torch.manual_seed(0)
    model, x = _TwoBlocks(), torch.randn(5, 3)
    torch.autograd.backward(model(x), create_graph=True)
    rng = torch.random.get_rng_state()
    result = Eigenvalue(max_iter=200, tol=1e-7, layer_name="layers", layer_num=2).compute_eigenvalue(model)
    assert torch.equal(rng, torch.random.get_rng_state())  # the training run's random stream is untouched
    values = {block: value for value, block in result.values()}
    assert values[1] == 1.0 and values[0] == pytest.approx(0.25, abs=1e-4)  # normalised by the largest
    top = torch.linalg.eigvalsh(x.T @ x).max().item()
    raw = Eigenvalue(max_iter=200, tol=1e-7, layer_name="layers", layer_num=1)._power_iteration(
        [model.layers[0].weight], None, 1.0, 0)
    assert raw == pytest.approx(top, rel=1e-4)


def test_without_a_gradient_graph_nothing_is_estimated():
    model = _TwoBlocks()
    model(torch.randn(4, 3)).backward()
    assert Eigenvalue(layer_name="layers", layer_num=2).compute_eigenvalue(model) == {}
    with pytest.raises(ValueError, match="has no attribute 'blocks'"):
        Eigenvalue(layer_name="blocks", layer_num=2).compute_eigenvalue(model)


def _train(eigenvalue: bool) -> tuple[list, list, list]:
    import deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "eigenvalue": {"enabled": eigenvalue, "layer_name": "layers", "layer_num": 2, "max_iter": 200,
                             "tol": 1e-7, "gas_boundary_resolution": 2}}
    engine, *_ = deepspeed.initialize(model=_TwoBlocks(), config=config)
    events = []
    engine.monitor = type("Recorder", (), {"write_events": lambda self, e: events.extend(e),
                                            "close": lambda self: None})()
    per_step = []
    for _ in range(4):  # 2 optimizer steps
        for _ in range(2):
            engine.backward(engine(torch.randn(5, 3)))
            engine.step()
        per_step.append(None if engine.block_eigenvalue is None else
                        sorted(round(v, 3) for v, _ in engine.block_eigenvalue.values()))
    return [p.detach().clone() for p in engine.module.parameters()], per_step, events


def test_engine_estimates_at_every_resolution_th_boundary():
    (plain, _, plain_events), (weights, per_step, events) = run_distributed(
        lambda: (_train(False), _train(True)), world_size=1, timeout=90)[0]
    # create_graph does not change the gradients: the weights equal a run without eigenvalues
    assert all(torch.equal(a, b) for a, b in zip(plain, weights, strict=True))
    # boundaries 1 and 3 are skipped (resolution 2); the same data gives the same ratio 1 : 4
    assert per_step == [None, [0.25, 1.0], [0.25, 1.0], [0.25, 1.0]]
    names = [name for name, _, _ in events if name.startswith("Train/Eigenvalues/")]
    assert names == ["Train/Eigenvalues/ModelBlockParam_0", "Train/Eigenvalues/ModelBlockParam_1"] * 2
    assert [s for name, _, s in events if name.endswith("_0")] == [10, 30]  # global_samples at the estimate
    assert not [e for e in plain_events if e[0].startswith("Train/Eigenvalues/")]


def _with_zero() -> str:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 1},
              "eigenvalue": {"enabled": True, "layer_name": "layers", "layer_num": 2}}
    try:
        deepspeed.initialize(model=_TwoBlocks(), config=config)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_zero_stages_are_refused_naming_the_key():
    message = run_distributed(_with_zero, world_size=1, timeout=60)[0]
    assert "eigenvalue.enabled" in message and "zero_optimization.stage is 1" in message
