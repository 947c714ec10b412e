"""``PipelineModule`` on real gloo ranks: each rank builds only its stage's layers (constructor calls counted),
the stages chained by hand (activations and gradients sent point-to-point) equal the unpartitioned model, and
tied layers on two stages start equal and all-reduce their gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_pipe import LayerSpec, PipeDataParallelTopology, PipelineModule, TiedLayerSpec


class Counted(nn.Module):
    """Records every construction: (layer id, the device its weight was made on)."""

    built: list[tuple[int, str]] = []

    def __init__(self, ident: int, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        Counted.built.append((ident, self.lin.weight.device.type))

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _build_counted(method, n: int = 8, topology=None) -> dict:
    Counted.built = []
    specs = [LayerSpec(Counted, i) for i in range(n)]
    pipe = PipelineModule(specs, num_stages=None if topology else 2, topology=topology, partition_method=method)
    real = [i for i, device in Counted.built if device != "meta"]
    return {"real": real, "meta": len(Counted.built) - len(real), "parts": pipe.parts, "stage": pipe.stage_id,
            "local": [int(name) for name, _ in pipe.named_children() if name.isdigit()],
            "grid_stage": pipe.mpu().get_stage_id()}


def test_each_rank_builds_only_its_stage():
    for method, parts in [("uniform", [0, 4, 8]), ("parameters", [0, 4, 8]), ("type:count", [0, 4, 8]),
                          ([0, 2, 8], [0, 2, 8]), ("0,5,8", [0, 5, 8])]:
        got = run_distributed(_build_counted, world_size=2, args=(method,), timeout=60)
        for rank, r in enumerate(got):
            mine = list(range(parts[rank], parts[rank + 1]))
            assert r["real"] == mine and r["local"] == mine, (method, rank, r)
            assert (r["parts"], r["stage"], r["grid_stage"]) == (parts, rank, rank)
            assert r["meta"] == (8 if method == "parameters" else 0)  # counting parameters builds on meta only


def test_two_stages_two_replicas():
    got = run_distributed(_build_counted, world_size=4, args=("uniform", 8, PipeDataParallelTopology(2, 2)),
                          timeout=60)
    assert [r["stage"] for r in got] == [0, 0, 1, 1]
    assert [r["real"] for r in got] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2


def _chain(module: PipelineModule, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Forward then backward through two stages on ranks 0 and 1; the loss (rank 1) is ``out.square().sum()``."""
    if module.stage_id == 0:
        y = module(x)
        dist.send(y.detach(), 1)
        grad = torch.empty_like(y)
        dist.recv(grad, 1)
        y.backward(grad)
        return None, None
    h = torch.empty(x.shape[0], 4)
    dist.recv(h, 0)
    h.requires_grad_(True)
    out = module(h)
    out.square().sum().backward()
    dist.send(h.grad, 0)
    return out.detach(), None


def _stage_run(interval: int) -> dict:
    specs = [LayerSpec(Counted, i) if i % 3 else nn.ReLU() for i in range(6)]
    module = PipelineModule(specs, num_stages=2, seed_layers=True, partition_method="uniform",
                            activation_checkpoint_interval=interval)
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    out, _ = _chain(module, x)
    grads = {n: p.grad for n, p in module.named_parameters()}
    # the unpartitioned model, built in this process with the same per-layer seeds
    layers = []
    for idx, spec in enumerate(specs):
        torch.manual_seed(1234 + idx)
        layers.append(spec.build() if isinstance(spec, LayerSpec) else spec)
    ref = nn.Sequential(*layers)
    ref_out = ref(x)
    ref_out.square().sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if n in grads}
    return {"out": out, "ref_out": ref_out.detach(), "grads": grads, "ref_grads": ref_grads}


def test_stages_chained_by_hand_equal_the_sequential_model():
    for interval in (0, 1):
        got = run_distributed(_stage_run, world_size=2, args=(interval,), timeout=60)
        torch.testing.assert_close(got[1]["out"], got[1]["ref_out"])
        for r in got:
            assert r["grads"].keys() == r["ref_grads"].keys() and r["grads"]
            for name, grad in r["grads"].items():
                torch.testing.assert_close(grad, r["ref_grads"][name])


def _tied_run() -> dict:
    specs = [TiedLayerSpec("embed", nn.Linear, 4, 4, bias=False), LayerSpec(nn.Linear, 4, 4),
             LayerSpec(nn.Linear, 4, 4),
             TiedLayerSpec("embed", nn.Linear, 4, 4, bias=False, forward_fn=lambda m, x: x @ m.weight)]
    torch.manual_seed(100 + dist.get_rank())  # the tied copies start different; construction syncs them
    module = PipelineModule(specs, num_stages=2, partition_method="uniform")
    weight = module.tied_modules["embed"].weight
    start = weight.detach().clone()
    torch.manual_seed(0)
    _chain(module, torch.randn(3, 4))
    local_grad = weight.grad.clone()
    module.allreduce_tied_weight_gradients()
    return {"start": start, "local_grad": local_grad, "grad": weight.grad.clone(),
            "params": {n: p.detach() for n, p in module.named_parameters()},
            "replicated": weight.ds_pipe_replicated, "ranks": module.tied_comms["embed"]["ranks"],
            "groups": len(module.get_tied_weights_and_groups())}


def test_tied_layers_on_two_stages_share_and_allreduce_gradients():
    r0, r1 = run_distributed(_tied_run, world_size=2, timeout=60)
    torch.testing.assert_close(r0["start"], r1["start"], rtol=0, atol=0)
    assert (r0["ranks"], r1["ranks"], r0["groups"], r1["groups"]) == ([0, 1], [0, 1], 1, 1)
    assert (r0["replicated"], r1["replicated"]) == (False, True)  # counted once, on the lowest rank
    # the same model in one process: one weight used at both ends, its gradient the sum of both uses
    w = r0["start"].clone().requires_grad_(True)
    w1, b1 = r0["params"]["1.weight"].clone().requires_grad_(True), r0["params"]["1.bias"]
    w2, b2 = r1["params"]["2.weight"], r1["params"]["2.bias"]
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    h = nn.functional.linear(nn.functional.linear(nn.functional.linear(x, w), w1, b1), w2, b2)
    (h @ w).square().sum().backward()
    torch.testing.assert_close(r0["local_grad"] + r1["local_grad"], w.grad)
    torch.testing.assert_close(r0["grad"], w.grad)
    torch.testing.assert_close(r1["grad"], w.grad)


def _too_many_stages() -> str:
    try:
        PipelineModule([nn.ReLU()], num_stages=2)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_more_stages_than_layers_fails_on_every_rank():
    for message in run_distributed(_too_many_stages, world_size=2, timeout=60):
        assert "more stages (num_stages=2) than layers (1)" in message


def _world_mismatch() -> list[str]:
    out = []
    for kwargs in ({"num_stages": 3}, {"topology": PipeDataParallelTopology(2, 2)}):
        try:
            PipelineModule([nn.ReLU()] * 4, **kwargs)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_stages_inconsistent_with_the_world_size():
    for messages in run_distributed(_world_mismatch, world_size=2, timeout=60):
        assert "num_stages=3 must divide the world size (2)" in messages[0]
        assert "has 4 ranks but runs on the world size (2)" in messages[1]
