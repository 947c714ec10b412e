"""Muon under ZeRO on 2 gloo ranks: stages 0, 1, 2 and 3 (and CPU optimizer offload, gradient clipping, both
Newton-Schulz methods) end with the parameters of a single-process run of ds-ops' SingleDeviceMuonWithAuxAdam
on the whole batch, so every stage orthogonalises each weight's full averaged gradient, including the weight
that straddles the two ranks' stage 1/2 partitions."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

from ds_ops.muon import SingleDeviceMuonWithAuxAdam

WORLD, MICRO, STEPS = 2, 4, 3
LR, ADAM_LR, MOMENTUM, WD = 0.05, 0.01, 0.9, 0.01


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 6)  # a matrix that stays with Adam (its name)
        self.fc1 = torch.nn.Linear(6, 10)  # Muon weights: 60 + 40 elements, so fc1.weight spans both partitions
        self.fc2 = torch.nn.Linear(10, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x + self.embed(ids))))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def data() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = WORLD * MICRO
    return [(torch.randint(7, (n,), generator=gen), torch.randn(n, 6, generator=gen), torch.randn(n, 4, generator=gen))
            for _ in range(STEPS)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def config(stage: int, ns_method: str, clip: float, offload: bool) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "gradient_clipping": clip,
            "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM,
                                                     "weight_decay": WD, "ns_method": ns_method}},
            "zero_optimization": zero}


def _train(cases: list[tuple[int, str, float, bool]]) -> list[dict[str, torch.Tensor]]:
    import torch.distributed as dist

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    rank, out = dist.get_rank(), []
    for stage, ns_method, clip, offload in cases:
        model = make_net()
        engine, *_ = deepspeed.initialize(model=model, config=config(stage, ns_method, clip, offload))
        for ids, x, y in data():
            part = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(loss_fn(engine(ids[part], x[part]), y[part]))
            engine.step()
        final = {}
        for name, p in engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)
            final[name] = (full if full is not None else p.detach()).float().clone()
        out.append(final)
        engine.destroy()
    return out


def reference(ns_method: str, clip: float) -> dict[str, torch.Tensor]:
    model = make_net()
    muon = [model.fc1.weight, model.fc2.weight]
    adam = [model.embed.weight, model.fc1.bias, model.fc2.bias]
    opt = SingleDeviceMuonWithAuxAdam([
        {"params": muon, "use_muon": True, "lr": LR, "momentum": MOMENTUM, "weight_decay": WD, "ns_method": ns_method},
        {"params": adam, "use_muon": False, "lr": ADAM_LR, "weight_decay": WD}])
    for ids, x, y in data():
        opt.zero_grad()
        loss_fn(model(ids, x), y).backward()  # the mean over the whole batch = the ranks' average
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [(0, "gram", 0.0, False), (1, "gram", 0.0, False), (2, "gram", 0.0, False), (3, "gram", 0.0, False),
         (1, "standard", 0.05, False), (2, "standard", 0.05, True), (3, "standard", 0.05, False)]


@pytest.fixture(scope="module")
def trained() -> list[dict[str, torch.Tensor]]:
    return run_distributed(_train, world_size=WORLD, args=(CASES,), timeout=240)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"zero{s}-{m}-clip{c}{'-offload' if o else ''}"
                                                            for s, m, c, o in CASES])
def test_zero_muon_matches_single_process_muon(trained, index):
    stage, ns_method, clip, offload = CASES[index]
    expected = reference(ns_method, clip)
    start = {n: p.detach() for n, p in make_net().named_parameters()}
    for rank_result in trained:
        got = rank_result[index]
        assert set(got) == set(expected)
        for name, value in got.items():
            assert not torch.equal(value, start[name]), f"{name} did not move"
            torch.testing.assert_close(value, expected[name], rtol=2e-5, atol=2e-5, msg=f"{name}, ZeRO-{stage}")
    torch.testing.assert_close(trained[0][index], trained[1][index], rtol=0, atol=0)  # ranks agree bitwise


def _resume(stage: int, ckpt: str, phase: str) -> dict[str, torch.Tensor]:
    """``save``: 2 steps then a checkpoint, then the third step; ``load``: the checkpoint, then the third step."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = WORLD * MICRO // world  # the same global batch on any world size
    cfg = {**config(stage, "gram", 0.0, False), "train_micro_batch_size_per_gpu": micro}
    engine, *_ = deepspeed.initialize(model=make_net(), config=cfg)
    batches = data()
    if phase == "load":
        engine.load_checkpoint(ckpt, tag="t")
        batches = batches[2:]
    for step, (ids, x, y) in enumerate(batches):
        part = slice(rank * micro, (rank + 1) * micro)
        engine.backward(loss_fn(engine(ids[part], x[part]), y[part]))
        engine.step()
        if phase == "save" and step == 1:
            engine.save_checkpoint(ckpt, tag="t")
    state = engine.optimizer.optimizer.state
    has_momentum = any("momentum_buffer" in s for s in state.values())
    out = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"params": out, "momentum": has_momentum}


@pytest.mark.parametrize("stage,load_world", [(2, 2), (2, 1), (3, 2)])
def test_zero_muon_momentum_survives_a_checkpoint(tmp_path, stage, load_world):
    straight = run_distributed(_resume, world_size=WORLD, args=(stage, str(tmp_path), "save"), timeout=240)[0]
    resumed = run_distributed(_resume, world_size=load_world, args=(stage, str(tmp_path), "load"), timeout=240)[0]
    assert straight["momentum"] and resumed["momentum"]
    for name, value in straight["params"].items():  # a lost momentum would change the third update
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-6, atol=1e-6, msg=name)


def _client_optimizer(stage: int) -> dict[str, torch.Tensor]:
    """The stand-alone ``original_muon.MuonWithAuxAdam``, passed by the client, under ZeRO."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam
    from deepspeed.utils import safe_get_full_fp32_param

    model = make_net()
    opt = MuonWithAuxAdam([
        {"params": [model.fc1.weight, model.fc2.weight], "use_muon": True, "lr": LR, "momentum": MOMENTUM,
         "weight_decay": WD, "ns_method": "gram"},
        {"params": [model.embed.weight, model.fc1.bias, model.fc2.bias], "use_muon": False, "lr": ADAM_LR,
         "weight_decay": WD}])
    cfg = {k: v for k, v in config(stage, "gram", 0.0, False).items() if k != "optimizer"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    rank = dist.get_rank()
    for ids, x, y in data():
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(loss_fn(engine(ids[part], x[part]), y[part]))
        engine.step()
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_client_muon_optimizer_under_zero(stage):
    got = run_distributed(_client_optimizer, world_size=WORLD, args=(stage,), timeout=240)[0]
    expected = reference("gram", 0.0)
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=2e-5, atol=2e-5, msg=name)
